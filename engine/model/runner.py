"""The torch model runner: a real transformer behind `kvbank.engine.runner.ModelRunner`.

One `run` is one forward pass over every row of the step (prefill chunks and decode tokens
flattened into one token batch), the KV written into the request's pages, and one sample per row
that asks for it. The pool's page ids are the scheduler's; this runner only owns the tensors.
"""

from __future__ import annotations

import torch

from kvbank.engine.model.attention import (
    AttentionBackend,
    PagedBatch,
    allocate_cache,
    build_paged_batch,
    make_attention,
)
from kvbank.engine.model.hostcache import HostCache
from kvbank.engine.model.llama import CausalLM
from kvbank.engine.model.sampling import Sampler
from kvbank.engine.runner import StepBatch, StepResult


class TorchRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        eos_token_id: int,
        attention: str = "torch",
        seed: int = 0,
        host_pages: int = 0,
    ) -> None:
        param = model.embedding
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.eos_token_id = eos_token_id
        config = model.config
        self.caches = allocate_cache(
            config.num_layers, num_pages, page_size, model.kv_heads, config.head_dim,
            self.dtype, self.device,
        )  # fmt: skip
        # Evicted prefix pages copied out and reloaded (the scheduler's host tier).
        self.host = HostCache(self.caches, host_pages) if host_pages else None
        self.backend: AttentionBackend = make_attention(
            attention,
            config.num_heads // model.parallel.world,
            model.kv_heads,
            config.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler(self.device, seed)

    def cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.caches)

    def forward(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        """Run the step and return the float32 logits [vocab] of every row that samples."""
        if batch.moves:
            if self.host is None:
                raise ValueError(
                    f"step {batch.step} moves {len(batch.moves)} pages to or from a host tier, "
                    f"but this runner has none; build it with host_pages"
                )
            self.host.apply(batch.moves, self.caches)
        if not batch.rows:
            return {}
        paged = self._paged(batch)
        ids = [t for row in batch.rows for t in row.token_ids]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        sampled = [
            (row.rid, span.q_end - 1)
            for row, span in zip(batch.rows, paged.rows, strict=True)
            if row.sample
        ]
        with torch.inference_mode():
            self.backend.plan(paged)
            hidden = self.model(input_ids, paged, self.caches, self.backend)
            if not sampled:
                return {}
            last = torch.tensor([i for _, i in sampled], dtype=torch.long, device=self.device)
            logits = self.model.logits(hidden[last])
        return {rid: logits[i] for i, (rid, _) in enumerate(sampled)}

    def run(self, batch: StepBatch) -> StepResult:
        logits = self.forward(batch)
        if not logits:
            return StepResult({})
        params = {row.rid: row.sampling for row in batch.rows if row.sample}
        rids = list(logits)
        stacked = torch.stack([logits[r] for r in rids])
        sampled = self.sampler.sample_with_logprobs(stacked, [(r, params[r]) for r in rids])
        tokens = {r: t for r, t in zip(rids, sampled.tokens, strict=True) if t is not None}
        return StepResult(tokens, logprobs=sampled.logprobs, failed=sampled.failed)

    def release(self, rid: str) -> None:
        self.sampler.forget(rid)

    def _paged(self, batch: StepBatch) -> PagedBatch:
        for row in batch.rows:
            bad = [p for p in row.page_ids if not 0 <= p < self.num_pages]
            if bad:
                raise ValueError(
                    f"request {row.rid} names pages {bad[:4]} outside this pool of "
                    f"{self.num_pages} pages"
                )
        rows = [(r.start_pos, len(r.token_ids), r.page_ids) for r in batch.rows]
        return build_paged_batch(rows, self.page_size, self.device)
