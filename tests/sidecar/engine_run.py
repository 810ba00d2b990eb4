"""A closed-loop run of a benchmark scenario through the real engine on the virtual clock, with a
chosen admission backend, recording what the identity and fault tests compare: the admitted
order (decisions in sequence order) and every completion."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.bench.workload import generate
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.ledger import Admitted

# Copies of two benchmark scenarios, kept here so these tests do not depend on files outside the
# repository.
SCENARIOS = Path(__file__).resolve().with_name("scenarios")


@dataclass
class RunRecord:
    admitted: list[str] = field(default_factory=list)
    completions: dict[str, tuple[str, int]] = field(default_factory=dict)  # rid -> reason, tokens
    steps: int = 0


class Recording:
    """Wraps a backend's answers (in-step tries, polls) to record admissions in the order the
    engine applies them."""

    def __init__(self, backend: Any, record: RunRecord) -> None:
        self._backend = backend
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @property
    def later(self) -> Recording | None:
        """Itself over a backend that answers later, so its decisions are recorded too."""
        return self if self._backend.later is not None else None

    def try_admit(self, rid: str, hit: Any, prefill_chunks: int | None = None) -> Any:
        decision = self._backend.try_admit(rid, hit, prefill_chunks)
        if decision is not None:
            self._record.admitted.append(decision.rid)
        return decision

    def poll(self, room: int) -> list[Any]:
        return self._seen(self._backend.poll(room))

    def collect(self) -> list[Any]:
        return self._seen(self._backend.collect())

    def _seen(self, decisions: list[Any]) -> list[Any]:
        decisions = sorted(decisions, key=lambda d: d.seq)
        self._record.admitted += [d.rid for d in decisions if isinstance(d, Admitted)]
        return decisions


def scenario(name: str, requests: int, concurrency: int) -> Scenario:
    loaded = load_scenario(SCENARIOS / f"{name}.yaml")
    workload = replace(loaded.workload, requests=requests, concurrency=concurrency)
    return replace(loaded, workload=workload)


def run(
    sc: Scenario,
    backend: Any,
    on_step: Callable[[int], None] = lambda step: None,
    max_steps: int = 200_000,
    policy: str = "banker",
) -> RunRecord:
    record = RunRecord()
    config = EngineConfig(sc.model, sc.pages, policy=policy, debug=True)
    runner = VirtualRunner(sc.cost, seed=sc.workload.seed)
    engine = Engine(config, runner, Recording(backend, record))
    specs = generate(sc.workload)
    live: set[str] = set()
    tokens: dict[str, int] = {}
    concurrency = sc.workload.concurrency or 8
    while True:
        while len(live) < concurrency and (spec := next(specs, None)) is not None:
            engine.add_request(
                spec.rid,
                spec.prompt,
                spec.cls.max_tokens,
                extra_tokens=dict(spec.cls.fixed_label_tokens or {}),
                labels=spec.cls.only_labels,
            )
            runner.stop_after(spec.rid, spec.output_tokens)
            live.add(spec.rid)
        if not engine.has_work():
            return record
        on_step(record.steps)
        for out in engine.step():
            tokens[out.rid] = tokens.get(out.rid, 0) + len(out.new_token_ids)
            if out.finished:
                live.discard(out.rid)
                reason = out.finish_reason.name if out.finish_reason else "?"
                assert out.rid not in record.completions, f"{out.rid} finished twice"
                record.completions[out.rid] = (reason, tokens.pop(out.rid, 0))
        engine.check_integrity(deep=True)
        record.steps += 1
        assert record.steps < max_steps, "the run did not finish"
