"""The virtual-clock runner: model time from a cost model, tokens without a model.

It drives the real scheduler, KV manager and ledger; only the forward pass is replaced. A step
costs

    step_base_ms + prefill_ms_per_token x prefill tokens + decode_ms_per_row x decode rows
                 + attn_ms_per_page x pages the step reads
                 + host_ms_per_page x pages the step copies to or from the host tier

and every token is a pure function of (seed, request id, output index), so a run is
deterministic for a seed. A request stops where its workload says the model would: the runner
emits the stop token as its `output_tokens`-th token (max_tokens may end it earlier).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from kvbank.engine.runner import StepBatch, StepResult

EOS_TOKEN_ID = 1
VOCAB = 32000


@dataclass(frozen=True)
class CostModel:
    step_base_ms: float = 8.0
    prefill_ms_per_token: float = 0.02
    decode_ms_per_row: float = 0.05
    attn_ms_per_page: float = 0.002
    host_ms_per_page: float = 0.0  # one page copied between device and host, either way

    def step_seconds(
        self, prefill_tokens: int, decode_rows: int, pages_read: int, pages_moved: int = 0
    ) -> float:
        return (
            self.step_base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_row * decode_rows
            + self.attn_ms_per_page * pages_read
            + self.host_ms_per_page * pages_moved
        ) / 1000.0


class VirtualRunner:
    eos_token_id = EOS_TOKEN_ID

    def __init__(self, cost: CostModel | None = None, seed: int = 0) -> None:
        self.cost = cost or CostModel()
        self.seed = seed
        self._stop_after: dict[str, int] = {}  # rid -> output length at which to emit eos
        self._sampled: dict[str, int] = {}
        self._bases: dict[str, int] = {}

    def stop_after(self, rid: str, output_tokens: int) -> None:
        """The model would end this request with its `output_tokens`-th token."""
        self._stop_after[rid] = output_tokens

    def run(self, batch: StepBatch) -> StepResult:
        prefill = decode = pages = 0
        tokens: dict[str, int] = {}
        for row in batch.rows:
            count = len(row.token_ids)
            # A decode row feeds one token and samples; anything else is prompt work.
            if count == 1 and row.sample and row.start_pos > 0:
                decode += 1
            else:
                prefill += count
            pages += len(row.page_ids)
            if row.sample:
                tokens[row.rid] = self._next_token(row.rid)
        moved = len(batch.moves)
        return StepResult(tokens, self.cost.step_seconds(prefill, decode, pages, moved))

    def _next_token(self, rid: str) -> int:
        index = self._sampled.get(rid, 0) + 1
        self._sampled[rid] = index
        if index >= self._stop_after.get(rid, 1 << 62):
            return EOS_TOKEN_ID
        base = self._bases.get(rid)
        if base is None:
            base = self._bases[rid] = zlib.crc32(f"{self.seed}:{rid}".encode())
        return 2 + (base + index * 2654435761) % (VOCAB - 2)  # a multiplicative hash step

    def release(self, rid: str) -> None:
        self._stop_after.pop(rid, None)
        self._sampled.pop(rid, None)
        self._bases.pop(rid, None)
