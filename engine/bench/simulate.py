"""One policy over one scenario on the virtual clock: the real engine, simulated model time.

The driver plays the clients (closed loop: each sends its next request when its last ends; open
loop: Poisson arrivals) into one `Replica` (engine/bench/replica.py), which advances its clock by
each step's cost-model time, and stops early on a deadlock: no token produced for `DEADLOCK_S`
virtual seconds while requests are waiting or running. Every step ends with an integrity check;
a breach is counted, not raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.bench.replica import DEADLOCK_S, Replica
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.stats import percentile, served_metrics
from kvbank.engine.bench.workload import Arrivals, RequestSpec
from kvbank.engine.engine import Engine
from kvbank.ledger.client import LedgerClient
from kvbank.service_class import ClassPolicy

__all__ = ["DEADLOCK_S", "RunResult", "run_policy", "served_metrics"]

# The names the vLLM bench (engine/bench/vllm_simulate.py) reads from here.
_percentile = percentile


@dataclass
class RunResult:
    scenario: str
    policy: str
    metrics: dict[str, Any]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s, held, running)
    # (s, pages held by the running requests of each class, in the workload's class order; a
    # page two requests share counts for both)
    class_timeline: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)


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
    replica = Replica(scenario, policy, debug, backend, classes, check)
    engine = replica.engine
    if prepare is not None:
        prepare(engine)
    workload = scenario.workload
    arrivals = Arrivals(workload)
    bar = _progress_bar(workload.requests, f"{scenario.name}/{policy}") if progress else None
    done = 0

    def send(spec: RequestSpec) -> None:
        if not replica.send(spec) and bar is not None:
            bar.update(1)

    while True:
        arrivals.refill(replica.clock, lambda: len(replica.tracks), send)
        if not engine.has_work():
            idle_until = arrivals.idle_until(replica.clock)
            if idle_until is not None:  # open loop, idle until the next arrival
                replica.idle_to(idle_until)
                continue
            break
        if not replica.step():
            break
        if bar is not None:
            finished = replica.counts["completed"] + replica.counts["failed"]
            bar.update(finished - done)
            done = finished
        if after_step is not None:
            after_step()
        if replica.overdue():
            break
    if bar is not None:
        bar.close()
    metrics = replica.metrics(workload.requests, replica.clock)
    return RunResult(scenario.name, policy, metrics, replica.timeline, replica.class_timeline)


def _progress_bar(total: int, label: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional; run without a bar
        return None
    # No delay: a run of a second or two shows its bar too (it is cleared when done).
    return tqdm(total=total, desc=label, unit="req", leave=False)
