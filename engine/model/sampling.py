"""Turn a step's logits into tokens: greedy, or temperature / top-k / top-p with per-request seeds,
after logit_bias and presence/frequency penalties, with log-probabilities when asked.

A request with a seed gets its own generator, created at its first sample and dropped when it
leaves, so its output depends only on its seed and its logits, not on what it was batched with.
Penalties read the request's own output so far, which the sampler counts as it samples (a
request preempted and recomputed keeps its output, and so its counts).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvbank.engine.runner import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # llguidance loads only for a server that constrains output
    from kvbank.engine.model.grammar import GrammarCompiler, Matcher


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        self._counts: dict[str, Counter[int]] = {}  # output tokens of penalised requests
        self.grammars: GrammarCompiler | None = None  # set by a server that takes grammars
        self._matchers: dict[str, Matcher] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]) -> list[int]:
        """logits: [rows, vocab] float32 -> one token per row."""
        return self.sample_with_logprobs(logits, rows)[0]

    def sample_with_logprobs(
        self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]
    ) -> tuple[list[int], dict[str, TokenLogprob]]:
        """logits: [rows, vocab] float32 -> one token per row, and the log-probabilities of the
        rows whose params ask for them."""
        adjusted = self._adjust(logits, rows)
        greedy = adjusted.argmax(dim=-1).tolist()
        tokens: list[int] = []
        logprobs: dict[str, TokenLogprob] = {}
        for i, (rid, params) in enumerate(rows):
            if params.temperature <= 0.0:
                token = int(greedy[i])
            else:
                probs = probabilities(adjusted[i], params)
                drawn = torch.multinomial(probs, 1, generator=self._generator(rid, params))
                token = int(drawn.item())
            tokens.append(token)
            if params.penalised:
                self._counts.setdefault(rid, Counter())[token] += 1
            if params.grammar is not None:
                self._matchers[rid].consume(token)
            if params.logprobs is not None:
                logprobs[rid] = token_logprob(adjusted[i], token, params.logprobs)
        return tokens, logprobs

    def forget(self, rid: str) -> None:
        self._seeded.pop(rid, None)
        self._counts.pop(rid, None)
        self._matchers.pop(rid, None)

    def _adjust(
        self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]
    ) -> torch.Tensor:
        """logit_bias, then penalties on what each request generated so far, then its grammar's
        mask; a copy only when some row asks for one of them."""
        if not any(p.logit_bias or p.penalised or p.grammar is not None for _, p in rows):
            return logits
        adjusted = logits.clone()
        for i, (rid, params) in enumerate(rows):
            if params.logit_bias:
                ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
                bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device)
                adjusted[i].index_add_(0, ids, bias.to(adjusted.dtype))
            counts = self._counts.get(rid)
            if params.penalised and counts:
                ids = torch.tensor(list(counts), device=logits.device)
                times = torch.tensor(list(counts.values()), device=logits.device)
                penalty = params.frequency_penalty * times + params.presence_penalty
                adjusted[i].index_add_(0, ids, -penalty.to(adjusted.dtype))
            if params.grammar is not None:
                self._matcher(rid, params.grammar).mask(adjusted[i])
        return adjusted

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
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, dim=-1)
