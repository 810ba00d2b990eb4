"""One policy over one scenario through vLLM's real scheduler, on the virtual clock.

The clients are played as in kvbank.engine.bench.simulate (closed or open loop, the same
requests from the same seed), the clock advances by each step's cost-model time, a run stops
early on a deadlock (no token for DEADLOCK_S virtual seconds while requests wait or run), and the
same metrics come out. Progress, finishes and their reasons are read from vLLM's own outputs.
Each request carries its class as a client sends it to vLLM (`service_tier` flex in vllm_xargs
for a best-effort class, kvbank.vllm.classes); stock vLLM ignores it.
"""

from __future__ import annotations

from typing import Any

from kvbank.engine.bench.outcomes import (
    Outcome,
    PreemptionCount,
    admission_by_class,
    class_metrics,
)
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.simulate import (
    DEADLOCK_S,
    RunResult,
    _percentile,
    _progress_bar,
    served_metrics,
)
from kvbank.engine.bench.vllm_engine import FinishReason, VllmBench
from kvbank.engine.bench.workload import Arrivals, RequestSpec
from kvbank.ledger import InvariantBreach, LedgerError
from kvbank.service_class import ServiceClass
from kvbank.vllm.settings import Settings

# `kvbank bench --engine vllm` policies: stock vLLM, and vLLM with kvbank's scheduler class
# running the named ledger policy with its waiting requests in the named order (arrival, or
# the prefix order: kvbank/vllm/order.py, KVBANK_ORDER).
VLLM_POLICIES: dict[str, tuple[str, str] | None] = {
    "vllm": None,
    "vllm+banker": ("banker", "fifo"),
    "vllm+peak+backfill": ("peak+backfill", "fifo"),
    "vllm+peak+backfill+prefix": ("peak+backfill", "prefix"),
}


def run_vllm_policy(
    scenario: Scenario,
    policy: str,
    debug: bool = False,
    progress: bool = False,
    sidecar: str | None = None,
    async_scheduling: bool = False,
) -> RunResult:
    """`sidecar` (host:port) keeps a kvbank policy's ledger in that `kvbank sidecar`, which
    must run the same policy; `async_scheduling` steps vLLM as its async scheduling does."""
    kvbank = VLLM_POLICIES[policy]
    ledger_policy = kvbank[0] if kvbank is not None else None
    settings = None
    if kvbank is not None:  # a bench waits for the sidecar's answers: the embedded run
        settings = Settings(kvbank[0], sidecar, blocking=True, order=kvbank[1])
    bench = VllmBench(scenario, settings, async_scheduling=async_scheduling)
    workload = scenario.workload
    arrivals = Arrivals(workload)
    sent: dict[str, tuple[RequestSpec, float]] = {}
    outcomes: dict[str, Outcome] = {}
    first_token: set[str] = set()
    ttft: dict[str, list[float]] = {}
    e2e: list[float] = []
    counts = {"completed": 0, "rejected": 0, "failed": 0, "preemptions": 0, "stalled_rows": 0}
    admitted_tokens = hit_tokens = max_running = 0
    clock = last_progress = util_area = 0.0
    timeline: list[tuple[float, int, int]] = []
    breaches, stop = 0, ""
    bar = _progress_bar(workload.requests, f"{scenario.name}/{policy}") if progress else None

    def send(spec: RequestSpec) -> None:
        tier = "flex" if spec.cls.service_class is ServiceClass.BEST_EFFORT else None
        bench.add(spec.rid, spec.prompt, spec.cls.max_tokens, spec.output_tokens, tier)
        sent[spec.rid] = (spec, clock)
        outcomes[spec.rid] = Outcome(spec.cls, PreemptionCount(), clock)

    while True:
        arrivals.refill(clock, lambda: len(sent), send)
        if not bench.has_work():
            idle_until = arrivals.idle_until(clock)
            if idle_until is not None:  # open loop, idle until the next arrival
                clock = last_progress = idle_until
                continue
            break
        try:
            step = bench.step()
            if debug or ledger_policy is not None:
                bench.check_integrity()
        except (InvariantBreach, LedgerError) as exc:
            breaches += 1
            stop = f"invariant breach: {exc}"
            break
        clock += step.seconds
        util_area += step.seconds * bench.held_pages / bench.usable_pages
        counts["preemptions"] += step.preempted
        counts["stalled_rows"] += step.unscheduled_running
        admitted_tokens += step.admitted_tokens
        hit_tokens += step.hit_tokens
        for rid in step.preempted_ids:
            if rid in outcomes:
                outcomes[rid].req.preemptions += 1
        for rid, start, count in step.rows:
            if rid in outcomes:
                outcomes[rid].on_row(start, count)
        for out in step.outputs:
            entry = sent.get(out.request_id)
            if entry is None:
                continue
            spec, sent_s = entry
            if out.new_token_ids:
                last_progress = clock
                outcomes[out.request_id].on_tokens(len(out.new_token_ids), clock)
                if out.request_id not in first_token:
                    first_token.add(out.request_id)
                    ttft.setdefault(spec.cls.name, []).append(clock - sent_s)
            if out.finish_reason is not None:
                del sent[out.request_id]
                ran = out.request_id in first_token
                first_token.discard(out.request_id)
                if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    counts["completed"] += 1
                    outcomes[out.request_id].completed = True
                    e2e.append(clock - sent_s)
                elif out.finish_reason == FinishReason.ERROR and not ran:
                    counts["rejected"] += 1  # refused before it ran: the pool can never hold it
                else:
                    counts["failed"] += 1
                if bar is not None:
                    bar.update(1)
        running = len(bench.sched.running)
        max_running = max(max_running, running)
        timeline.append((clock, bench.held_pages, running))
        if clock - last_progress > DEADLOCK_S:
            stop = f"deadlock: no token for {DEADLOCK_S:g} s at {clock:.1f} s"
            break
        if clock > scenario.time_limit_s:
            stop = f"time limit {scenario.time_limit_s:g} s"
            break
    if bar is not None:
        bar.close()
    metrics: dict[str, Any] = {
        "scenario": scenario.name,
        "policy": policy,
        "engine": "vllm",
        "tp": scenario.tp,
        "pool_pages": scenario.pages,
        **served_metrics(workload.requests, counts, clock, ttft, e2e, util_area),
        "preemptions": counts["preemptions"],
        # Running requests vLLM gave no tokens in a step (token budget or, stock, pages).
        "stalled_rows": counts["stalled_rows"],
        "stalled_steps": bench.stalled_steps,
        "prefix_hit_rate": round(hit_tokens / admitted_tokens, 4) if admitted_tokens else 0.0,
        "invariant_breaches": breaches,
        "max_running": max_running,
        "steps": bench.steps,
        "stopped": stop or "finished",
        "admitted_as": admission_by_class(workload.classes, baseline=ledger_policy is None),
        **class_metrics(outcomes.values(), workload.classes, clock, _percentile),
        # This bench runs vLLM with no host tier.
        "host_pages": 0,
        "host_pages_saved": 0,
        "host_pages_reloaded": 0,
    }
    return RunResult(scenario.name, policy, metrics, timeline)
