"""Turn a step's logits into tokens: greedy, or temperature / top-k / top-p with per-request seeds.

A request with a seed gets its own generator, created at its first sample and dropped when it
leaves, so its output depends only on its seed and its logits, not on what it was batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbank.engine.runner import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]) -> list[int]:
        """logits: [rows, vocab] float32 -> one token per row."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for i, (rid, params) in enumerate(rows):
            if params.temperature <= 0.0:
                tokens.append(int(greedy[i]))
                continue
            probs = probabilities(logits[i], params)
            token = torch.multinomial(probs, 1, generator=self._generator(rid, params))
            tokens.append(int(token.item()))
        return tokens

    def forget(self, rid: str) -> None:
        self._seeded.pop(rid, None)

    def _generator(self, rid: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._seeded.get(rid)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._seeded[rid] = gen
        return gen


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
