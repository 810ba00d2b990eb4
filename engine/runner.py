"""The model-runner interface the scheduler drives.

Two runners sit behind it: the virtual-clock runner (step time from a cost model, tokens without
a model, for benchmarks) and the torch runner (a real transformer on the paged KV cache). The
scheduler, KV manager and ledger are the same for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvbank.engine.kv.host import HostMove


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    # Subtracted from a token's logit once it appeared in the output (presence), and per time
    # it appeared (frequency), as OpenAI's API defines them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k: the sampled token's and the k likeliest
    ignore_eos: bool = False  # run to max_tokens past the model's end-of-text token
    grammar: str | None = None  # an llguidance grammar the output must match

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the likeliest alternatives at its position, under
    the distribution after logit_bias and penalties and before temperature, top-k and top-p."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass(frozen=True)
class RowFailure:
    """Why a row could not be sampled: its request ends with this, and only its request.
    `param` names the request field behind it (response_format for a grammar that gave up)."""

    message: str
    param: str | None = None


@dataclass(frozen=True)
class RowInput:
    """One request's share of a step: a prefill chunk, or the one token a decode row feeds."""

    rid: str
    token_ids: Sequence[int]  # tokens whose KV this step writes
    start_pos: int  # position of token_ids[0]; equals the request's num_computed
    page_ids: Sequence[int]  # the request's pages for the attended label, covering every position
    sample: bool  # sample a token after this row (last prefill chunk, or decode)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class StepBatch:
    step: int
    rows: Sequence[RowInput]
    # Pages copied between the device pool and the host tier, in the order the scheduler
    # decided them; the runner copies them, in this order, before the forward pass.
    moves: Sequence[HostMove] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(frozen=True)
class StepResult:
    tokens: dict[str, int]  # the sampled token of every row that sampled
    # Model time of this step in seconds when the runner keeps a virtual clock; None when the
    # runner is real and wall-clock time is what counts.
    duration_s: float | None = None
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # rows that asked for them
    # Rows that sampled nothing, with why: their requests end with an error, the others run on.
    failed: dict[str, RowFailure] = field(default_factory=dict)


class ModelRunner(Protocol):
    eos_token_id: int

    def run(self, batch: StepBatch) -> StepResult: ...

    def release(self, rid: str) -> None:
        """Forget per-request state (sampler seeds, say) once a request leaves."""
        ...
