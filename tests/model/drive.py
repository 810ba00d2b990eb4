"""Drive a runner step by step with hand-made page tables (no scheduler): the model's contract
with the engine is only RowInput -> StepResult, so these tests pin the model, not the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank.engine.model.runner import TorchRunner
from kvbank.engine.runner import RowInput, SamplingParams, StepBatch


@dataclass
class Seq:
    rid: str
    prompt: list[int]
    pages: list[int]
    computed: int = 0  # positions whose KV is written
    output: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class PageCounter:
    def __init__(self, first: int = 1) -> None:
        self.next = first

    def take(self, count: int) -> list[int]:
        pages = list(range(self.next, self.next + count))[::-1]  # descending: not contiguous
        self.next += count
        return pages


def generate(
    runner: TorchRunner,
    seqs: list[Seq],
    max_new: int,
    chunk: int | None = None,
    together: bool = True,
) -> dict[str, list[int]]:
    """Run prefill (in chunks of `chunk` tokens, if given) then decode `max_new` tokens."""
    groups = [seqs] if together else [[s] for s in seqs]
    step = 0
    for group in groups:
        while any(len(s.output) < max_new for s in group):
            rows = []
            for s in group:
                if len(s.output) >= max_new:
                    continue
                todo = len(s.tokens) - s.computed
                take = min(todo, chunk) if chunk else todo
                end = s.computed + take
                rows.append(
                    RowInput(
                        s.rid,
                        s.tokens[s.computed : end],
                        s.computed,
                        s.pages,
                        end == len(s.tokens),
                        s.sampling,
                    )
                )
                s.computed = end
            result = runner.run(StepBatch(step, rows))
            step += 1
            for s in group:
                if s.rid in result.tokens:
                    s.output.append(result.tokens[s.rid])
    return {s.rid: s.output for s in seqs}
