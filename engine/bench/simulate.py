"""One policy over one scenario on the virtual clock: the real engine, simulated model time.

The driver plays the clients (closed loop: each sends its next request when its last ends; open
loop: Poisson arrivals), advances the clock by each step's cost-model time (an empty step costs
`step_base_ms`, so a stalled engine still sees time pass), and stops early on a deadlock: no
token produced for `DEADLOCK_S` virtual seconds while requests are waiting or running. Every
step ends with an integrity check; a breach is counted, not raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.bench.outcomes import Outcome, RowObserver, admission_by_class, class_metrics
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.bench.workload import Arrivals, RequestSpec
from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.request import FinishReason
from kvbank.ledger import InvariantBreach, LedgerError
from kvbank.ledger.client import LedgerClient
from kvbank.service_class import ClassPolicy

DEADLOCK_S = 30.0


@dataclass
class RunResult:
    scenario: str
    policy: str
    metrics: dict[str, Any]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s, held, running)
    # (s, pages held by the running requests of each class, in the workload's class order; a
    # page two requests share counts for both)
    class_timeline: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)


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
    backend: LedgerClient | None = None,
    prepare: Callable[[Engine], None] | None = None,
    after_step: Callable[[], None] | None = None,
    classes: ClassPolicy | None = None,
    check: bool = False,
) -> RunResult:
    """`backend` replaces the embedded ledger (kvbank.sidecar.backend for a sidecar);
    `prepare` sees the engine before the first request, `after_step` runs after every step
    (a benchmark that times the policy, or paces steps in wall time); `classes` are the pool's
    class settings (victim rule, output estimate, preemption bound); `check` runs the second,
    independent safety check (engine/safety.py) after every step (`debug` runs it too)."""
    config = EngineConfig(
        scenario.model,
        scenario.pages,
        policy=policy,
        host_pages=scenario.host_pages,
        classes=classes or ClassPolicy(),
        debug=debug,
    )
    runner = VirtualRunner(scenario.cost, seed=scenario.workload.seed)
    tracks: dict[str, Outcome] = {}  # requests in flight
    outcomes: list[Outcome] = []  # every request sent and taken
    engine = Engine(config, RowObserver(runner, tracks), backend)
    if prepare is not None:
        prepare(engine)
    workload = scenario.workload
    arrivals = Arrivals(workload)
    ttft: dict[str, list[float]] = {}
    e2e: list[float] = []
    counts = {"completed": 0, "rejected": 0, "failed": 0}
    clock = last_progress = util_area = 0.0
    breaches = 0
    stop = ""
    timeline: list[tuple[float, int, int]] = []
    class_timeline: list[tuple[float, tuple[int, ...]]] = []
    class_index = {c.name: i for i, c in enumerate(workload.classes)}
    usable = engine.kv.pool.usable_pages
    bar = _progress_bar(workload.requests, f"{scenario.name}/{policy}") if progress else None

    def send(spec: RequestSpec) -> None:
        cls = spec.cls
        try:
            req = engine.add_request(
                spec.rid,
                spec.prompt,
                cls.max_tokens,
                extra_tokens=dict(cls.fixed_label_tokens or {}),
                labels=cls.only_labels,
                service_class=cls.service_class,
            )
        except RequestRejected:
            counts["rejected"] += 1
            if bar is not None:
                bar.update(1)
            return
        runner.stop_after(spec.rid, spec.output_tokens)
        tracks[spec.rid] = outcome = Outcome(cls, req, clock)
        outcomes.append(outcome)

    while True:
        arrivals.refill(clock, lambda: len(tracks), send)
        if not engine.has_work():
            idle_until = arrivals.idle_until(clock)
            if idle_until is not None:  # open loop, idle until the next arrival
                clock = last_progress = idle_until
                continue
            break
        try:
            outputs = engine.step()  # in debug mode the engine checks deeply itself
            if not debug:
                engine.check_integrity()
                if check:
                    engine.check_safety()
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
                    ttft.setdefault(track.cls.name, []).append(clock - track.sent_s)
                track.on_tokens(len(out.new_token_ids), clock)
            if out.finished:
                del tracks[out.rid]
                if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    track.completed = True
                    counts["completed"] += 1
                    e2e.append(clock - track.sent_s)
                else:
                    counts["failed"] += 1
                if bar is not None:
                    bar.update(1)
        timeline.append((clock, engine.kv.pool.held, engine.num_running))
        by_class = [0] * len(class_index)
        for running in engine.sched.running.values():
            by_class[class_index[tracks[running.rid].cls.name]] += running.held
        class_timeline.append((clock, tuple(by_class)))
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
    # Imported here, not at the top: importing a policy module registers its policies, and the
    # registry's order (banker first) is the order of `--policy all`.
    from kvbank.engine.admission.baselines import FifoPolicy

    stats = engine.sched.stats
    metrics: dict[str, Any] = {
        "scenario": scenario.name,
        "policy": policy,
        "tp": scenario.tp,  # the pool is per rank and identical on every rank: rank 0 is run
        "pool_pages": scenario.pages,
        **served_metrics(workload.requests, counts, clock, ttft, e2e, util_area),
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
        # How each class was admitted, said plainly: the baselines and the banker policy run
        # every request as strict.
        "admitted_as": admission_by_class(
            workload.classes,
            isinstance(engine.policy, FifoPolicy),
            engine.policy.honours_classes,
        ),
        **class_metrics(outcomes, workload.classes, clock, _percentile),
        "host_pages": scenario.host_pages,
        "host_pages_saved": engine.kv.host.saved if engine.kv.host else 0,
        "host_pages_reloaded": engine.kv.host.loaded if engine.kv.host else 0,
    }
    return RunResult(scenario.name, policy, metrics, timeline, class_timeline)


def served_metrics(
    requests: int,
    counts: dict[str, int],
    duration_s: float,
    ttft: dict[str, list[float]],
    e2e: list[float],
    util_area: float,
) -> dict[str, Any]:
    """What every engine's run reports of the requests it served, in the bench's field order:
    `counts` has completed, rejected and failed; `ttft` is by class."""
    done = counts["completed"]
    all_ttft = [v for values in ttft.values() for v in values]
    return {
        "completed": done,
        "hung": requests - done - counts["rejected"] - counts["failed"],
        "rejected": counts["rejected"],
        "failed": counts["failed"],
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(done / duration_s, 4) if duration_s else 0.0,
        "ttft_p50_s": _percentile(all_ttft, 50),
        "ttft_p99_s": _percentile(all_ttft, 99),
        "ttft_by_class": {
            name: {"p50_s": _percentile(v, 50), "p99_s": _percentile(v, 99)}
            for name, v in sorted(ttft.items())
        },
        "e2e_p50_s": _percentile(e2e, 50),
        "kv_utilisation": round(util_area / duration_s, 4) if duration_s else 0.0,
    }


def _progress_bar(total: int, label: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional; run without a bar
        return None
    # No delay: a run of a second or two shows its bar too (it is cleared when done).
    return tqdm(total=total, desc=label, unit="req", leave=False)
