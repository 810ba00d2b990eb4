"""N engines behind a router on the virtual clock: `kvbank bench --replicas N --router R`.

Each replica is a whole engine with its own ledger, policy and clock (engine/bench/replica.py);
the router (engine/bench/routers.py) places each request as it arrives. Events run in time
order: an arrival (open loop), a client freed by a finished request (closed loop: it sends its
next request then), or the start of a replica's next step, whichever is soonest; a replica's
step runs whole, so a pick may see a replica's state up to one step ahead (a few ms of virtual
time). A request the router sheds (429) or refuses (400) frees its client at once. A request
the router holds (the kvbank picker's lobby) is asked again after every step of any replica;
its TTFT counts from its arrival, hold included.

Figures: the bench's usual ones for the whole pool and for each replica, and how many requests
the router placed where they then waited (not admitted in the first step after they arrived)
and for how long.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.bench.outcomes import class_metrics
from kvbank.engine.bench.replica import Replica
from kvbank.engine.bench.routers import make_router
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.stats import percentile, served_metrics
from kvbank.engine.bench.workload import Arrivals, RequestSpec
from kvbank.picker import Answer, NoEndpoint, Pick, Refuse, Shed
from kvbank.picker.lobby import DEFAULT_MAX_HOLD_S
from kvbank.service_class import ClassPolicy, ServiceClass


@dataclass
class ClusterResult:
    scenario: str
    router: str
    policy: str
    metrics: dict[str, Any]
    replicas: list[dict[str, Any]] = field(default_factory=list)


def run_cluster(
    scenario: Scenario,
    router_name: str,
    replicas: int,
    policy: str,
    scrape_s: float,
    classes: ClassPolicy | None = None,
    check: bool = False,
    debug: bool = False,
    max_hold_s: float = DEFAULT_MAX_HOLD_S,
) -> ClusterResult:
    """`replicas` engines under `policy` behind `router_name`, the scenario's traffic sent to
    the pool as a whole."""
    pool = [Replica(scenario, policy, debug, None, classes, check) for _ in range(replicas)]
    router = make_router(router_name, pool, scrape_s, scenario.workload.seed, max_hold_s)
    workload = scenario.workload
    arrivals = Arrivals(workload)
    freed: list[float] = []  # closed loop: when clients whose request ended are free again
    answers = {"shed": 0, "refused": 0, "no_endpoint": 0}
    shed_by_class: dict[str, int] = {}
    clock = 0.0
    stop = ""

    holds: list[float] = []  # how long each request the router held waited there
    held = 0

    def in_flight() -> int:
        return sum(len(r.tracks) for r in pool) + len(freed) + held

    def send(spec: RequestSpec) -> None:
        nonlocal held
        answer = router.route(spec, clock)
        if answer is None:
            held += 1
            release()
        else:
            place(spec, answer, clock)

    def release() -> None:
        nonlocal held
        while placed := router.release(clock):
            for one in placed:
                held -= 1
                holds.append(clock - one.since)
                place(one.spec, one.answer, one.since)

    def place(spec: RequestSpec, answer: Answer, since: float) -> None:
        if isinstance(answer, Pick):
            replica = pool[int(answer.pod)]
            replica.idle_to(clock)
            replica.send(spec, since)
            return
        if isinstance(answer, Shed):
            if workload.concurrency is not None:  # the client waits the Retry-After, as told
                heapq.heappush(freed, clock + answer.retry_after_s)
            answers["shed"] += 1
            shed_by_class[spec.cls.name] = shed_by_class.get(spec.cls.name, 0) + 1
        elif isinstance(answer, Refuse):
            answers["refused"] += 1
        elif isinstance(answer, NoEndpoint):
            answers["no_endpoint"] += 1

    while True:
        while freed and freed[0] <= clock:
            heapq.heappop(freed)
        arrivals.refill(clock, in_flight, send)
        busy = [r for r in pool if r.engine.has_work()]
        events = [r.clock for r in busy]
        upcoming = arrivals.idle_until(clock)
        if upcoming is not None:
            events.append(upcoming)
        if freed:
            events.append(freed[0])
        if not events:
            if held:  # a pod that is idle admits any request it can hold: never expected
                stop = f"the router holds {held} requests while every replica is idle"
            break
        soonest = min(events)
        replica = min(busy, key=lambda r: r.clock, default=None)
        if replica is None or replica.clock > soonest:
            clock = max(clock, soonest)  # an arrival or a freed client comes first
            continue
        clock = max(clock, replica.clock)
        before = len(replica.tracks)
        if not replica.step():
            stop = replica.stop
            break
        if workload.concurrency is not None:
            for _ in range(before - len(replica.tracks)):
                heapq.heappush(freed, replica.clock)
        if replica.overdue():
            stop = replica.stop
            break
        release()
    duration = max([clock, *(r.clock for r in pool)])
    strict = {c.name for c in workload.classes if c.service_class is ServiceClass.STRICT}
    per_replica = []
    for index, replica in enumerate(pool):
        figures = {
            "replica": index,
            "sent": replica.sent,
            **replica.metrics(replica.sent, duration),
            **_waits(replica),
        }
        figures["strict_preemptions"] = sum(
            n for name, n in figures["preemptions_by_class"].items() if name in strict
        )
        per_replica.append(figures)
    metrics = _pool_metrics(scenario, router.name, policy, pool, duration, answers)
    metrics["shed_by_class"] = shed_by_class
    waited_there = [h for h in holds if h > 0]
    metrics["held_by_router"] = len(waited_there)
    metrics["hold_p99_s"] = percentile(waited_there, 99)
    metrics["stopped"] = stop or "finished"
    return ClusterResult(scenario.name, router.name, policy, metrics, per_replica)


def _waits(replica: Replica) -> dict[str, Any]:
    """The requests this replica was sent that then waited to be admitted, and how long."""
    return _wait_figures([replica])


def _wait_figures(pool: Sequence[Replica]) -> dict[str, Any]:
    """Requests admitted later than the first step their replica ran after they arrived: the
    router placed them where the ledger could not admit them yet."""
    waits: list[float] = []
    strict_waits: list[float] = []
    for replica in pool:
        for wait, service_class in replica.waited.values():
            waits.append(wait)
            if service_class is ServiceClass.STRICT:
                strict_waits.append(wait)
    return {
        "routed_then_waited": len(waits),
        "strict_routed_then_waited": len(strict_waits),
        "wait_p50_s": percentile(waits, 50),
        "wait_p99_s": percentile(waits, 99),
        "strict_wait_p99_s": percentile(strict_waits, 99),
        "wait_max_s": round(max(waits), 4) if waits else None,
    }


def _pool_metrics(
    scenario: Scenario,
    router: str,
    policy: str,
    pool: Sequence[Replica],
    duration: float,
    answers: dict[str, int],
) -> dict[str, Any]:
    counts = {k: sum(r.counts[k] for r in pool) for k in ("completed", "rejected", "failed")}
    counts["rejected"] += answers["refused"]
    ttft: dict[str, list[float]] = {}
    for replica in pool:
        for name, values in replica.ttft.items():
            ttft.setdefault(name, []).extend(values)
    e2e = [v for r in pool for v in r.e2e]
    util_area = sum(r.util_area for r in pool) / len(pool)
    requests = scenario.workload.requests - answers["shed"] - answers["no_endpoint"]
    outcomes = [o for r in pool for o in r.outcomes]
    strict = {c.name for c in scenario.workload.classes if c.service_class is ServiceClass.STRICT}
    strict_ttft = [v for name, values in ttft.items() if name in strict for v in values]
    by_class = class_metrics(outcomes, scenario.workload.classes, duration, percentile)
    hit = sum(r.engine.sched.stats.hit_tokens for r in pool)
    prefill = sum(r.engine.sched.stats.prefill_tokens for r in pool)
    return {
        "scenario": scenario.name,
        "router": router,
        "policy": policy,
        "replicas": len(pool),
        "pool_pages": scenario.pages,
        **served_metrics(requests, counts, duration, ttft, e2e, util_area),
        "shed": answers["shed"],
        "no_endpoint": answers["no_endpoint"],
        "strict_ttft_p99_s": percentile(strict_ttft, 99),
        "prefix_hit_rate": round(hit / prefill, 4) if prefill else 0.0,
        "preemptions": sum(r.engine.sched.stats.preemptions for r in pool),
        "strict_preemptions": sum(
            n for name, n in by_class["preemptions_by_class"].items() if name in strict
        ),
        "invariant_breaches": sum(r.breaches for r in pool),
        **_wait_figures(pool),
        **by_class,
    }
