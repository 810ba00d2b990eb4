"""One policy over one scenario on the virtual clock: the real engine, simulated model time.

The driver plays the clients (closed loop: each sends its next request when its last ends; open
loop: Poisson arrivals), advances the clock by each step's cost-model time (an empty step costs
`step_base_ms`, so a stalled engine still sees time pass), and stops early on a deadlock: no
token produced for `DEADLOCK_S` virtual seconds while requests are waiting or running. Every
step ends with an integrity check; a breach is counted, not raised.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.admission.backend import AdmissionBackend
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.bench.workload import RequestSpec, generate
from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.request import FinishReason
from kvbank.ledger import InvariantBreach, LedgerError

DEADLOCK_S = 30.0


@dataclass
class _Track:
    spec: RequestSpec
    sent_s: float
    first_token_s: float | None = None


@dataclass
class RunResult:
    scenario: str
    policy: str
    metrics: dict[str, Any]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s, held, running)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return round(ordered[rank], 4)


def run_policy(
    scenario: Scenario,
    policy: str,
    debug: bool = False,
    progress: bool = False,
    backend: AdmissionBackend | None = None,
    prepare: Callable[[Engine], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> RunResult:
    """`backend` replaces the embedded ledger (kvbank.sidecar.backend for a sidecar);
    `prepare` sees the engine before the first request, `after_step` runs after every step
    (a benchmark that times the policy, or paces steps in wall time)."""
    config = EngineConfig(scenario.model, scenario.pages, policy=policy, debug=debug)
    runner = VirtualRunner(scenario.cost, seed=scenario.workload.seed)
    engine = Engine(config, runner, backend)
    if prepare is not None:
        prepare(engine)
    workload = scenario.workload
    specs = generate(workload)
    upcoming: deque[RequestSpec] = deque()
    tracks: dict[str, _Track] = {}
    ttft: dict[str, list[float]] = {}
    e2e: list[float] = []
    counts = {"completed": 0, "rejected": 0, "failed": 0}
    clock = last_progress = util_area = 0.0
    breaches = 0
    stop = ""
    timeline: list[tuple[float, int, int]] = []
    usable = engine.kv.pool.usable_pages
    bar = _progress_bar(workload.requests, f"{scenario.name}/{policy}") if progress else None

    def send(spec: RequestSpec) -> None:
        cls = spec.cls
        try:
            engine.add_request(
                spec.rid,
                spec.prompt,
                cls.max_tokens,
                extra_tokens=dict(cls.fixed_label_tokens or {}),
                labels=cls.only_labels,
            )
        except RequestRejected:
            counts["rejected"] += 1
            if bar is not None:
                bar.update(1)
            return
        runner.stop_after(spec.rid, spec.output_tokens)
        tracks[spec.rid] = _Track(spec, clock)

    def refill() -> None:
        if workload.concurrency is not None:
            while len(tracks) < workload.concurrency:
                spec = next(specs, None)
                if spec is None:
                    return
                send(spec)
            return
        while True:
            if not upcoming:
                spec = next(specs, None)
                if spec is None:
                    return
                upcoming.append(spec)
            if (upcoming[0].arrival_s or 0.0) > clock:
                return
            send(upcoming.popleft())

    while True:
        refill()
        if not engine.has_work():
            if upcoming:  # open loop, idle until the next arrival
                clock = max(clock, upcoming[0].arrival_s or clock)
                last_progress = clock
                continue
            break
        try:
            outputs = engine.step()  # in debug mode the engine checks deeply itself
            if not debug:
                engine.check_integrity()
        except (InvariantBreach, LedgerError) as exc:
            breaches += 1
            stop = f"invariant breach: {exc}"
            break
        result = engine.last_result
        duration = result.duration_s if result and result.duration_s else 0.0
        if not engine.last_rows:
            duration = scenario.cost.step_base_ms / 1000.0
        util_area += duration * engine.kv.pool.held / usable
        clock += duration
        for out in outputs:
            track = tracks.get(out.rid)
            if track is None:
                continue
            if out.new_token_ids:
                last_progress = clock
                if track.first_token_s is None:
                    track.first_token_s = clock
                    ttft.setdefault(track.spec.cls.name, []).append(clock - track.sent_s)
            if out.finished:
                del tracks[out.rid]
                if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    counts["completed"] += 1
                    e2e.append(clock - track.sent_s)
                else:
                    counts["failed"] += 1
                if bar is not None:
                    bar.update(1)
        timeline.append((clock, engine.kv.pool.held, engine.num_running))
        if after_step is not None:
            after_step()
        if clock - last_progress > DEADLOCK_S:
            stop = f"deadlock: no token for {DEADLOCK_S:g} s at {clock:.1f} s"
            break
        if clock > scenario.time_limit_s:
            stop = f"time limit {scenario.time_limit_s:g} s"
            break
    if bar is not None:
        bar.close()
    stats = engine.sched.stats
    done = counts["completed"]
    all_ttft = [v for values in ttft.values() for v in values]
    metrics: dict[str, Any] = {
        "scenario": scenario.name,
        "policy": policy,
        "tp": scenario.tp,  # the pool is per rank and identical on every rank: rank 0 is run
        "pool_pages": scenario.pages,
        "completed": done,
        "hung": workload.requests - done - counts["rejected"] - counts["failed"],
        "rejected": counts["rejected"],
        "failed": counts["failed"],
        "duration_s": round(clock, 3),
        "requests_per_s": round(done / clock, 4) if clock else 0.0,
        "ttft_p50_s": _percentile(all_ttft, 50),
        "ttft_p99_s": _percentile(all_ttft, 99),
        "ttft_by_class": {
            name: {"p50_s": _percentile(v, 50), "p99_s": _percentile(v, 99)}
            for name, v in sorted(ttft.items())
        },
        "e2e_p50_s": _percentile(e2e, 50),
        "kv_utilisation": round(util_area / clock, 4) if clock else 0.0,
        "preemptions": stats.preemptions,
        "stalled_rows": stats.stalled_rows,  # decode rows that sat a step out for want of a page
        # Steps in which a running request could not advance, so a peak-fit ledger admitted
        # conservatively (0 for the policies without one).
        "stalled_steps": getattr(engine.policy, "stalled_steps", 0),
        "prefix_hit_rate": round(stats.hit_tokens / stats.prefill_tokens, 4)
        if stats.prefill_tokens
        else 0.0,
        "invariant_breaches": breaches,
        "max_running": max((r for _, _, r in timeline), default=0),
        "steps": engine.steps,
        "stopped": stop or "finished",
    }
    return RunResult(scenario.name, policy, metrics, timeline)


def _progress_bar(total: int, label: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional; run without a bar
        return None
    # No delay: a run of a second or two shows its bar too (it is cleared when done).
    return tqdm(total=total, desc=label, unit="req", leave=False)
