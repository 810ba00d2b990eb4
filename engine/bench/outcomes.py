"""What each request of a benchmark run went through, as its client saw it, and the figures by
service class drawn from that: TPOT, the longest stall, goodput against the class's SLO,
preemptions and recomputed tokens.

The driver records one `Outcome` per request it sent: every token's arrival on the virtual clock,
and every row the runner computed for it (`RowObserver`), so a position computed a second time
after a preemption counts as recomputed exactly once per recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvbank.engine.bench.scenario import RequestClass, ServiceClass
from kvbank.engine.runner import ModelRunner, StepBatch, StepResult


class Preempted(Protocol):
    """What an outcome reads of its request: how often it was preempted (kvbank's `Request`,
    or the vLLM bench's count of vLLM's preemptions)."""

    preemptions: int


@dataclass
class PreemptionCount:
    preemptions: int = 0


@dataclass
class Outcome:
    cls: RequestClass
    req: Preempted
    sent_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    max_gap_s: float = 0.0  # the longest wait between two tokens of this request
    completed: bool = False
    computed_to: int = 0  # highest position whose KV was ever written, plus one
    recomputed: int = 0  # positions whose KV was written again (after a preemption)
    admitted_s: float | None = None  # the start of the step that first admitted it

    def on_tokens(self, count: int, now: float) -> None:
        if self.last_token_s is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_token_s)
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now
        self.tokens += count

    def on_row(self, start: int, count: int) -> None:
        end = start + count
        self.recomputed += max(0, min(end, self.computed_to) - start)
        self.computed_to = max(self.computed_to, end)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1)

    def met_slo(self) -> bool:
        """Completed, and within its class's SLO (every completed request, with no SLO)."""
        if not self.completed:
            return False
        slo = self.cls.slo
        ttft = self.ttft_s
        return slo is None or (ttft is not None and slo.met(ttft, self.tpot_s))


class RowObserver:
    """A runner that hands every row to the outcome of its request, then runs the real one."""

    def __init__(self, runner: ModelRunner, outcomes: dict[str, Outcome]) -> None:
        self.runner = runner
        self.outcomes = outcomes
        self.eos_token_id = runner.eos_token_id

    def run(self, batch: StepBatch) -> StepResult:
        for row in batch.rows:
            outcome = self.outcomes.get(row.rid)
            if outcome is not None:
                outcome.on_row(row.start_pos, len(row.token_ids))
        return self.runner.run(batch)

    def release(self, rid: str) -> None:
        self.runner.release(rid)


def admission_by_class(
    classes: Iterable[RequestClass], baseline: bool, honours: bool = True
) -> dict[str, str]:
    """How the policy admitted each class, said plainly: the baselines admit every class alike,
    as the engines they stand for would; kvbank's policies that honour classes admit best-effort
    requests as such (engine/admission/besteffort.py), the banker policy as strict."""
    if baseline:
        return {c.name: f"{c.service_class.value}, ignored by this baseline" for c in classes}
    return {
        c.name: "strict"
        if c.service_class is ServiceClass.STRICT
        else "best-effort"
        if honours
        else "best-effort, admitted as strict (this policy has no best-effort admission)"
        for c in classes
    }


def class_metrics(
    outcomes: Iterable[Outcome],
    classes: Iterable[RequestClass],
    duration_s: float,
    percentile: Any,
) -> dict[str, Any]:
    """The per-class figures of `kvbank bench --json`; `percentile(values, q)` is the driver's."""
    names = [c.name for c in classes]
    by_class: dict[str, list[Outcome]] = {name: [] for name in names}
    for outcome in outcomes:
        by_class.setdefault(outcome.cls.name, []).append(outcome)

    def per_s(count: int) -> float:
        return round(count / duration_s, 4) if duration_s else 0.0

    def tpots(group: list[Outcome]) -> list[float]:
        return [o.tpot_s for o in group if o.completed and o.tpot_s is not None]

    everyone = [o for group in by_class.values() for o in group]
    every_tpot = tpots(everyone)
    met = {name: sum(o.met_slo() for o in group) for name, group in by_class.items()}
    return {
        "service_classes": {
            c.name: {
                "service_class": c.service_class.value,
                "slo": None if c.slo is None else {"ttft_s": c.slo.ttft_s, "tpot_s": c.slo.tpot_s},
            }
            for c in classes
        },
        "preemptions_by_class": {
            name: sum(o.req.preemptions for o in group) for name, group in by_class.items()
        },
        "tpot_p50_s": percentile(every_tpot, 50),
        "tpot_p99_s": percentile(every_tpot, 99),
        "tpot_by_class": {
            name: {"p50_s": percentile(tpots(group), 50), "p99_s": percentile(tpots(group), 99)}
            for name, group in by_class.items()
        },
        "max_stall_s": round(max((o.max_gap_s for o in everyone), default=0.0), 4),
        "max_stall_by_class": {
            name: round(max((o.max_gap_s for o in group), default=0.0), 4)
            for name, group in by_class.items()
        },
        "goodput_per_s": per_s(sum(met.values())),
        "goodput_by_class": {
            name: {
                "per_s": per_s(met[name]),
                "met_slo": met[name],
                "completed": sum(o.completed for o in group),
            }
            for name, group in by_class.items()
        },
        "recomputed_tokens": sum(o.recomputed for o in everyone),
        "recomputed_by_class": {
            name: sum(o.recomputed for o in group) for name, group in by_class.items()
        },
    }
