"""One engine on its own virtual clock, as the bench drives it: requests in, one step at a time,
what its clients saw out. `kvbank bench` runs one (engine/bench/simulate.py); the cluster bench
runs several behind a router (engine/bench/cluster.py), each on its own clock.

Each step advances the replica's clock by the step's cost-model time (an empty step costs
`step_base_ms`, so a stalled engine still sees time pass) and ends with an integrity check; a
breach is counted and stops the replica, it is not raised.
"""

from __future__ import annotations

from typing import Any

from kvbank.engine.bench.outcomes import Outcome, RowObserver, admission_by_class, class_metrics
from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.stats import percentile, served_metrics
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.bench.workload import RequestSpec
from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.request import FinishReason
from kvbank.ledger import InvariantBreach, LedgerError
from kvbank.ledger.client import LedgerClient
from kvbank.service_class import ClassPolicy, ServiceClass

DEADLOCK_S = 30.0


class Replica:
    """One engine, its virtual-clock runner and the outcomes of the requests sent to it."""

    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        debug: bool = False,
        backend: LedgerClient | None = None,
        classes: ClassPolicy | None = None,
        check: bool = False,
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.debug, self.check = debug, check
        config = EngineConfig(
            scenario.model,
            scenario.pages,
            policy=policy,
            host_pages=scenario.host_pages,
            classes=classes or ClassPolicy(),
            debug=debug,
        )
        self.runner = VirtualRunner(scenario.cost, seed=scenario.workload.seed)
        self.tracks: dict[str, Outcome] = {}  # requests in flight
        self.outcomes: list[Outcome] = []  # every request sent and taken
        self.engine = Engine(config, RowObserver(self.runner, self.tracks), backend)
        self.ttft: dict[str, list[float]] = {}
        self.e2e: list[float] = []
        self.counts = {"completed": 0, "rejected": 0, "failed": 0}
        self.sent = 0
        self.output_tokens = 0  # written by the requests that completed: their mean is what
        # a pod can tell of how long the next ones will run
        self.clock = self.last_progress = self.util_area = 0.0
        self.step_s = scenario.cost.step_base_ms / 1000.0  # the last step's time
        self.breaches = 0
        self.stop = ""
        self.timeline: list[tuple[float, int, int]] = []  # (s, held, running)
        # (s, pages held by the running requests of each class, in the workload's class order)
        self.class_timeline: list[tuple[float, tuple[int, ...]]] = []
        self._class_index = {c.name: i for i, c in enumerate(scenario.workload.classes)}
        self._usable = self.engine.kv.pool.usable_pages
        # Per request sent: the engine's step count when it arrived (its first chance is that
        # step); once admitted, how long it waited when it missed that chance.
        self._first_chance: dict[str, int] = {}
        self.waited: dict[str, tuple[float, ServiceClass]] = {}

    # ---- requests in ---------------------------------------------------------------------------

    def send(self, spec: RequestSpec, now: float | None = None) -> bool:
        """Hand `spec` to the engine at `now` (default: the replica's clock); False when it
        was refused at arrival (the pool can never hold it)."""
        cls = spec.cls
        self.sent += 1
        try:
            req = self.engine.add_request(
                spec.rid,
                spec.prompt,
                cls.max_tokens,
                extra_tokens=dict(cls.fixed_label_tokens or {}),
                labels=cls.only_labels,
                service_class=cls.service_class,
            )
        except RequestRejected:
            self.counts["rejected"] += 1
            return False
        self.runner.stop_after(spec.rid, spec.output_tokens)
        sent = self.clock if now is None else now
        self.tracks[spec.rid] = outcome = Outcome(cls, req, sent)
        self.outcomes.append(outcome)
        self._first_chance[spec.rid] = self.engine.steps
        return True

    def idle_to(self, now: float) -> None:
        """With nothing to do, the replica's clock waits for `now` (the next request)."""
        if not self.engine.has_work() and now > self.clock:
            self.clock = self.last_progress = now

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step from the replica's clock; False on a breach (the reason in `stop`)."""
        engine = self.engine
        started, step_index = self.clock, engine.steps
        try:
            outputs = engine.step()  # in debug mode the engine checks deeply itself
            if not self.debug:
                engine.check_integrity()
                if self.check:
                    engine.check_safety()
        except (InvariantBreach, LedgerError) as exc:
            self.breaches += 1
            self.stop = f"invariant breach: {exc}"
            return False
        result = engine.last_result
        duration = result.duration_s if result and result.duration_s else 0.0
        if not engine.last_rows:
            duration = self.scenario.cost.step_base_ms / 1000.0
        self.step_s = duration
        self.util_area += duration * engine.kv.pool.held / self._usable
        self.clock += duration
        clock = self.clock
        running = engine.sched.running
        for rid, track in self.tracks.items():
            if track.admitted_s is None and rid in running:
                self._admitted(rid, track, started, step_index)
        for out in outputs:
            if out.rid not in self.tracks:
                continue
            track = self.tracks[out.rid]
            if track.admitted_s is None:  # admitted and finished in one step
                self._admitted(out.rid, track, started, step_index)
            if out.new_token_ids:
                self.last_progress = clock
                if track.first_token_s is None:
                    self.ttft.setdefault(track.cls.name, []).append(clock - track.sent_s)
                track.on_tokens(len(out.new_token_ids), clock)
            if out.finished:
                del self.tracks[out.rid]
                if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    track.completed = True
                    self.counts["completed"] += 1
                    self.output_tokens += track.tokens
                    self.e2e.append(clock - track.sent_s)
                else:
                    self.counts["failed"] += 1
        self.timeline.append((clock, engine.kv.pool.held, engine.num_running))
        by_class = [0] * len(self._class_index)
        for req in running.values():
            by_class[self._class_index[self.tracks[req.rid].cls.name]] += req.held
        self.class_timeline.append((clock, tuple(by_class)))
        return True

    def _admitted(self, rid: str, track: Outcome, started: float, step_index: int) -> None:
        track.admitted_s = started
        if step_index > self._first_chance.pop(rid, step_index):
            self.waited[rid] = (started - track.sent_s, track.cls.service_class)

    @property
    def mean_output(self) -> float | None:
        """Output tokens per completed request so far (None before the first completes)."""
        done = self.counts["completed"]
        return self.output_tokens / done if done else None

    def overdue(self) -> bool:
        """Whether the run must stop after this step: no token for `DEADLOCK_S` virtual seconds
        with requests waiting or running, or past the scenario's time limit (`stop` says)."""
        clock = self.clock
        if clock - self.last_progress > DEADLOCK_S:
            self.stop = f"deadlock: no token for {DEADLOCK_S:g} s at {clock:.1f} s"
            return True
        if clock > self.scenario.time_limit_s:
            self.stop = f"time limit {self.scenario.time_limit_s:g} s"
            return True
        return False

    # ---- figures -------------------------------------------------------------------------------

    def metrics(self, requests: int, duration_s: float) -> dict[str, Any]:
        """The bench's figures for this replica: `requests` is how many it was sent (a lone
        engine: the scenario's), `duration_s` the run's virtual time."""
        # Imported here, not at the top: importing a policy module registers its policies, and
        # the registry's order (banker first) is the order of `--policy all`.
        from kvbank.engine.admission.baselines import FifoPolicy

        scenario, engine = self.scenario, self.engine
        workload = scenario.workload
        stats = engine.sched.stats
        return {
            "scenario": scenario.name,
            "policy": self.policy,
            "tp": scenario.tp,  # the pool is per rank and identical on every rank: rank 0 is run
            "pool_pages": scenario.pages,
            **served_metrics(
                requests, self.counts, duration_s, self.ttft, self.e2e, self.util_area
            ),
            "preemptions": stats.preemptions,
            # Decode rows that sat a step out for want of a page.
            "stalled_rows": stats.stalled_rows,
            # Steps in which a running request could not advance, so a peak-fit ledger
            # admitted conservatively (0 for the policies without one).
            "stalled_steps": getattr(engine.policy, "stalled_steps", 0),
            "prefix_hit_rate": round(stats.hit_tokens / stats.prefill_tokens, 4)
            if stats.prefill_tokens
            else 0.0,
            "invariant_breaches": self.breaches,
            "max_running": max((r for _, _, r in self.timeline), default=0),
            "steps": engine.steps,
            "stopped": self.stop or "finished",
            # How each class was admitted, said plainly: the baselines and the banker policy
            # run every request as strict.
            "admitted_as": admission_by_class(
                workload.classes,
                isinstance(engine.policy, FifoPolicy),
                engine.policy.honours_classes,
            ),
            **class_metrics(self.outcomes, workload.classes, duration_s, percentile),
            "host_pages": scenario.host_pages,
            "host_pages_saved": engine.kv.host.saved if engine.kv.host else 0,
            "host_pages_reloaded": engine.kv.host.loaded if engine.kv.host else 0,
        }
