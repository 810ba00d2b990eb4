"""Turn a step's logits into tokens: greedy, or temperature / top-k / top-p with per-request seeds,
after logit_bias and presence/frequency penalties, with log-probabilities when asked.

A request with a seed gets its own generator, created at its first sample and dropped when it
leaves, so its output depends only on its seed and its logits, not on what it was batched with.
Penalties read the request's own output so far, which the sampler counts as it samples (a
request preempted and recomputed keeps its output, and so its counts).

A row that cannot be sampled (its grammar gave up, its distribution came out empty) fails that
row alone: its request ends with the reason, and the step's other rows are sampled as usual. One
request's numbers must never stop the engine thread every other request runs on.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvbank.engine.runner import RowFailure, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # llguidance loads only for a server that constrains output
    from kvbank.engine.model.grammar import GrammarCompiler, Matcher

# Below this a temperature is greedy and a top_p keeps only the likeliest token, as vLLM reads
# them: logits / 1e-39 overflow to inf, and a float32 top_p of 1e-46 is 0, which cuts every
# token; either leaves softmax nothing but NaN.
SAMPLING_EPS = 1e-5


class Sampled(NamedTuple):
    """One step's draws, by row: the token (None where the row failed), the log-probabilities of
    the rows that asked for them, and why each failed row failed."""

    tokens: list[int | None]
    logprobs: dict[str, TokenLogprob]
    failed: dict[str, RowFailure]


class SamplingError(Exception):
    """A row that cannot be sampled; `param` is the request field behind it, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < SAMPLING_EPS or params.top_p < SAMPLING_EPS


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        self._counts: dict[str, Counter[int]] = {}  # output tokens of penalised requests
        self.grammars: GrammarCompiler | None = None  # set by a server that takes grammars
        self._matchers: dict[str, Matcher] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]) -> list[int]:
        """logits: [rows, vocab] float32 -> one token per row; raises if a row failed."""
        sampled = self.sample_with_logprobs(logits, rows)
        for failure in sampled.failed.values():
            raise SamplingError(failure.message, failure.param)
        return [t for t in sampled.tokens if t is not None]

    def sample_with_logprobs(
        self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]
    ) -> Sampled:
        """logits: [rows, vocab] float32 -> one token per row (None for a row that failed, with
        its reason), and the log-probabilities of the rows whose params ask for them."""
        failed: dict[str, RowFailure] = {}
        adjusted = self._adjust(logits, rows, failed)
        # One transfer for the batch: each row's likeliest token, and whether its best logit is
        # finite (-inf: every token forbidden; NaN or +inf: nothing to draw from).
        best, greedy = adjusted.max(dim=-1)
        drawable = torch.isfinite(best).tolist()
        greedy_ids = greedy.tolist()
        tokens: list[int | None] = []
        logprobs: dict[str, TokenLogprob] = {}
        for i, (rid, params) in enumerate(rows):
            token = None
            if rid not in failed and not drawable[i]:
                failed[rid] = RowFailure(
                    f"request {rid}: no token is left to sample (after logit_bias, the penalties "
                    "and the grammar every logit is -inf, or one is NaN or inf)"
                )
            if rid not in failed:
                try:
                    token = self._draw(rid, params, adjusted[i], int(greedy_ids[i]))
                    if params.logprobs is not None:
                        logprobs[rid] = token_logprob(adjusted[i], token, params.logprobs)
                except Exception as exc:  # this row's fault; the others are still sampled
                    failed[rid] = _failure(rid, exc)
                    token = None
            tokens.append(token)
        return Sampled(tokens, logprobs, failed)

    def _draw(self, rid: str, params: SamplingParams, row: torch.Tensor, greedy: int) -> int:
        """row: [vocab], adjusted -> the token drawn, counted and fed to the row's grammar."""
        if is_greedy(params):
            token = greedy
        else:
            probs = probabilities(row, params)
            drawn = torch.multinomial(probs, 1, generator=self._generator(rid, params))
            token = int(drawn.item())
        if params.penalised:
            self._counts.setdefault(rid, Counter())[token] += 1
        if params.grammar is not None:
            self._matchers[rid].consume(token)
        return token

    def forget(self, rid: str) -> None:
        self._seeded.pop(rid, None)
        self._counts.pop(rid, None)
        self._matchers.pop(rid, None)

    def _adjust(
        self,
        logits: torch.Tensor,
        rows: Sequence[tuple[str, SamplingParams]],
        failed: dict[str, RowFailure],
    ) -> torch.Tensor:
        """logit_bias, then penalties on what each request generated so far, then its grammar's
        mask; a copy only when some row asks for one of them. A row that fails is put in
        `failed`."""
        if not any(p.logit_bias or p.penalised or p.grammar is not None for _, p in rows):
            return logits
        adjusted = logits.clone()
        for i, (rid, params) in enumerate(rows):
            try:
                self._adjust_row(rid, params, adjusted[i])
            except Exception as exc:
                failed[rid] = _failure(rid, exc)
        return adjusted

    def _adjust_row(self, rid: str, params: SamplingParams, row: torch.Tensor) -> None:
        """row: [vocab], in place."""
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=row.device)
            bias = torch.tensor([b for _, b in params.logit_bias], device=row.device)
            row.index_add_(0, ids, bias.to(row.dtype))
        counts = self._counts.get(rid)
        if params.penalised and counts:
            ids = torch.tensor(list(counts), device=row.device)
            times = torch.tensor(list(counts.values()), device=row.device)
            penalty = params.frequency_penalty * times + params.presence_penalty
            row.index_add_(0, ids, -penalty.to(row.dtype))
        if params.grammar is not None:
            self._matcher(rid, params.grammar).mask(row)

    def _matcher(self, rid: str, grammar: str) -> Matcher:
        matcher = self._matchers.get(rid)
        if matcher is None:
            if self.grammars is None:
                raise ValueError(f"request {rid} has a grammar, but this sampler has no compiler")
            matcher = self._matchers[rid] = self.grammars.matcher(grammar)
        return matcher

    def _generator(self, rid: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._seeded.get(rid)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._seeded[rid] = gen
        return gen


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits: [vocab] -> the log-probability of `token` and the `top` likeliest tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))
        # A token a grammar or a -100 bias forbids is no alternative (and -inf is no JSON).
        alternatives = tuple(
            (t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -math.inf
        )
    return TokenLogprob(float(logp[token].item()), alternatives)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab] -> probabilities after temperature, top-k and top-p (nucleus) cuts."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does. The first token always stays.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        drop[0] = False  # a float32 top_p can round to 0, which would drop every token
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, dim=-1)


def _failure(rid: str, exc: Exception) -> RowFailure:
    if isinstance(exc, SamplingError):
        return RowFailure(str(exc), exc.param)
    return RowFailure(f"request {rid} could not be sampled: {type(exc).__name__}: {exc}"[:500])
