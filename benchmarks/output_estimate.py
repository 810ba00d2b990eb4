"""How well each output estimator foresees a best-effort request's output, over a scenario's
own requests: what an admission would reserve beside what the request then writes.

For every best-effort class of each scenario, the requests are taken in arrival order; each is
estimated when it arrives (nothing written yet), and its real length (where the model stops,
capped at its budget: `max_tokens`, or the model's limit) is learned `--lag` requests later, as
if that many were in flight. Printed per estimator: tokens reserved per token written (1.0 is
exact; above it the pool holds room nobody uses), the share of requests that outgrow their
estimate (each one must grow past its reservation, and on a full pool be preempted), and by how
much they outgrow it on average. SGLang's decaying ratio depends on the steps since the last
preemption, so it is shown at both ends: 0.7 (just after one) and its floor 0.1 (long after).

    .venv/bin/python benchmarks/output_estimate.py scenarios/voice-and-batch.yaml \\
        scenarios/chat-best-effort.yaml [--lag 32]
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvbank.capacity import RequestShape, count_pages
from kvbank.engine.admission.estimate import DecayingRatio, LearnedLengths
from kvbank.engine.bench.scenario import Scenario, ServiceClass, load_scenario
from kvbank.engine.bench.workload import generate

Estimate = Callable[[str, int], int]  # (class, budget) -> expected output tokens


@dataclass
class Score:
    reserved: int = 0
    written: int = 0
    outgrown: int = 0
    shortfall: int = 0
    requests: int = 0

    def line(self, name: str) -> str:
        share = self.outgrown / self.requests if self.requests else 0.0
        short = self.shortfall / self.outgrown if self.outgrown else 0.0
        return (
            f"  {name:<31} reserved/written {self.reserved / max(1, self.written):5.2f}   "
            f"outgrown {share:6.1%}   by {short:7.1f} tokens on average"
        )


def measure(scenario: Scenario, lag: int) -> None:
    classes = scenario.workload.classes
    names = {c.name for c in classes if c.service_class is ServiceClass.BEST_EFFORT}
    if not names:
        print(f"{scenario.name}: no best-effort class")
        return
    learned = {q: LearnedLengths(quantile=q) for q in (0.5, 0.9, 0.99)}
    estimators: dict[str, Estimate] = {
        "ratio 0.7 (after a preemption)": _ratio(0.7),
        "ratio 0.1 (its floor)": _ratio(0.1),
        **{f"learned p{round(q * 100)}": _fresh(e) for q, e in learned.items()},
        "whole budget (strict)": lambda c, b: b,
    }
    scores = {name: Score() for name in estimators}
    pending: deque[tuple[str, int]] = deque()
    for spec in generate(scenario.workload):
        cls = spec.cls
        if cls.name not in names:
            continue
        shape = RequestShape(len(spec.prompt), cls.max_tokens)
        budget = count_pages(scenario.model, shape).output_tokens
        written = min(spec.output_tokens, budget)
        for name, estimate in estimators.items():
            expected = estimate(cls.name, budget)
            score = scores[name]
            score.requests += 1
            score.reserved += expected
            score.written += written
            if written > expected:
                score.outgrown += 1
                score.shortfall += written - expected
        pending.append((cls.name, written))
        if len(pending) > lag:
            done_class, done_length = pending.popleft()
            for e in learned.values():
                e.observe(done_class, done_length)
    print(f"{scenario.name} ({', '.join(sorted(names))}), learned with a lag of {lag} requests:")
    for name, score in scores.items():
        print(score.line(name))


def _fresh(learned: LearnedLengths) -> Estimate:
    return lambda c, b: learned.expected_output(c, 0, b)


def _ratio(value: float) -> Estimate:
    ratio = DecayingRatio(initial=value, floor=value)
    return lambda c, b: ratio.expected_output(c, 0, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="+", help="scenario YAML files")
    parser.add_argument("--lag", type=int, default=32, help="requests in flight before one ends")
    args = parser.parse_args()
    for path in args.scenarios:
        measure(load_scenario(path), args.lag)


if __name__ == "__main__":
    main()
