"""Paged attention over one page layout shared by two backends.

The KV cache of one layer is a single tensor

    cache: [num_pages, 2, page_size, kv_heads_per_rank, head_dim]   (index 0 = K, 1 = V)

which is FlashInfer's "NHD" paged layout, so the CUDA kernels and the torch path read the very
same pages. Token position p of a request lives in page `page_ids[p // page_size]` at offset
`p % page_size`. Writing the step's new K/V is shared; only the read differs:

- `TorchAttention` gathers a row's pages and runs causal scaled_dot_product_attention. It is the
  reference and the CPU path; its cost is a copy of each row's context per layer per step.
- `FlashInferAttention` plans FlashInfer's batch prefill/decode wrappers once per step and runs
  them per layer. flashinfer is imported when the backend is built, never at module import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("torch", "flashinfer")


@dataclass(frozen=True)
class RowSpan:
    """One row of the flat batch: query tokens [q_start, q_end), attending to kv_len positions."""

    q_start: int
    q_end: int
    start_pos: int
    kv_len: int
    page_ids: torch.Tensor  # [pages covering kv_len], long, on the cache's device


@dataclass(frozen=True)
class PagedBatch:
    """Where every token of a step sits; built once per step, read by every layer."""

    positions: torch.Tensor  # [tokens] long
    write_pages: torch.Tensor  # [tokens] long: the page each token's K/V goes to
    write_offsets: torch.Tensor  # [tokens] long: its slot in that page
    rows: tuple[RowSpan, ...]
    page_size: int

    @property
    def is_decode(self) -> bool:
        return all(r.q_end - r.q_start == 1 for r in self.rows)


def build_paged_batch(
    rows: Sequence[tuple[int, int, Sequence[int]]], page_size: int, device: torch.device
) -> PagedBatch:
    """rows: (start_pos, new_tokens, page_ids) per row, in batch order."""
    positions: list[int] = []
    write_pages: list[int] = []
    spans: list[RowSpan] = []
    q = 0
    for start_pos, count, page_ids in rows:
        kv_len = start_pos + count
        needed = -(-kv_len // page_size)
        if len(page_ids) < needed:
            raise ValueError(
                f"a row at positions {start_pos}..{kv_len - 1} needs {needed} pages of "
                f"{page_size} tokens but was given {len(page_ids)}"
            )
        row_positions = list(range(start_pos, kv_len))
        positions.extend(row_positions)
        write_pages.extend(page_ids[p // page_size] for p in row_positions)
        ids = torch.tensor(list(page_ids[:needed]), dtype=torch.long, device=device)
        spans.append(RowSpan(q, q + count, start_pos, kv_len, ids))
        q += count
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    return PagedBatch(
        positions=pos,
        write_pages=torch.tensor(write_pages, dtype=torch.long, device=device),
        write_offsets=pos % page_size,
        rows=tuple(spans),
        page_size=page_size,
    )


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch) -> None:
    """k, v: [tokens, kv_heads, head_dim] -> their slots in cache."""
    cache[batch.write_pages, 0, batch.write_offsets] = k
    cache[batch.write_pages, 1, batch.write_offsets] = v


def allocate_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    # Zeroed: a sink page or an unwritten slot must never hold NaN that a mask would not hide.
    shape = (num_pages, 2, page_size, kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    def plan(self, batch: PagedBatch) -> None:
        """Prepare per-step metadata once; `attend` then runs for every layer."""
        ...

    def attend(self, q: torch.Tensor, cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""
        ...


class TorchAttention:
    """Gather + scaled_dot_product_attention. A decode-only step (every row one token) runs as
    one padded batch per layer: rows' page tables are padded with the sink page to the longest
    and the padding is masked, which costs reading the padding but saves a kernel launch and a
    gather per row. Rows with several query tokens (prefill chunks) run one by one."""

    def __init__(self) -> None:
        self._table: torch.Tensor | None = None  # [rows, max_pages] page ids, sink-padded
        self._mask: torch.Tensor | None = None  # [rows, 1, 1, max_pages * page_size]

    def plan(self, batch: PagedBatch) -> None:
        self._table = self._mask = None
        if not batch.is_decode or len(batch.rows) < 2:
            return
        device = batch.positions.device
        width = max(len(r.page_ids) for r in batch.rows)
        table = torch.zeros(len(batch.rows), width, dtype=torch.long, device=device)
        for i, row in enumerate(batch.rows):
            table[i, : len(row.page_ids)] = row.page_ids
        kv_lens = torch.tensor([r.kv_len for r in batch.rows], device=device)
        keys = torch.arange(width * batch.page_size, device=device)
        self._table = table
        self._mask = (keys[None, :] < kv_lens[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        if self._table is not None and self._mask is not None:
            return self._attend_decode(q, cache, self._table, self._mask)
        out = torch.empty_like(q)
        kv_heads, head_dim = cache.shape[3], cache.shape[4]
        for row in batch.rows:
            pages = cache[row.page_ids]  # [pages, 2, page_size, kv_heads, head_dim]
            k = pages[:, 0].reshape(-1, kv_heads, head_dim)[: row.kv_len]
            v = pages[:, 1].reshape(-1, kv_heads, head_dim)[: row.kv_len]
            q_row = q[row.q_start : row.q_end].transpose(0, 1)  # [heads, q_len, head_dim]
            q_len = row.q_end - row.q_start
            mask = None
            if q_len > 1:  # query i sits at start_pos + i and sees keys 0..start_pos + i
                q_pos = torch.arange(q_len, device=q.device)[:, None] + row.start_pos
                mask = torch.arange(row.kv_len, device=q.device)[None, :] <= q_pos
            attended = F.scaled_dot_product_attention(
                q_row, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
            )
            out[row.q_start : row.q_end] = attended.transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode(
        q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        rows, width = table.shape
        _, _, page_size, kv_heads, head_dim = cache.shape
        pages = cache[table]  # [rows, width, 2, page_size, kv_heads, head_dim]
        k = pages[:, :, 0].reshape(rows, width * page_size, kv_heads, head_dim).transpose(1, 2)
        v = pages[:, :, 1].reshape(rows, width * page_size, kv_heads, head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=True
        )  # [rows, heads, 1, head_dim]
        return attended[:, :, 0, :]


class FlashInferAttention:
    """FlashInfer's paged kernels; decode-only steps take the decode wrapper, others prefill."""

    WORKSPACE_BYTES = 128 << 20

    def __init__(
        self, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any
    ) -> None:
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(
                "--attention flashinfer needs the flashinfer-python package (pip install "
                "'kvbank[gpu]'); use --attention torch otherwise"
            ) from exc
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=num_heads // kv_heads >= 4
        )
        self._shape = (num_heads, kv_heads, head_dim)
        self._dtype = dtype
        self._device = device
        self._decoding = False

    def plan(self, batch: PagedBatch) -> None:
        heads, kv_heads, head_dim = self._shape
        ps = batch.page_size
        kv_indptr = [0]
        last_page_len = []
        for row in batch.rows:
            kv_indptr.append(kv_indptr[-1] + len(row.page_ids))
            last_page_len.append(row.kv_len - (len(row.page_ids) - 1) * ps)
        indices = torch.cat([r.page_ids for r in batch.rows]).to(torch.int32)
        indptr = torch.tensor(kv_indptr, dtype=torch.int32, device=self._device)
        last = torch.tensor(last_page_len, dtype=torch.int32, device=self._device)
        self._decoding = batch.is_decode
        if self._decoding:
            self._decode.plan(
                indptr, indices, last, heads, kv_heads, head_dim, ps,
                pos_encoding_mode="NONE", q_data_type=self._dtype, kv_data_type=self._dtype,
            )  # fmt: skip
            return
        qo = [0] + [r.q_end for r in batch.rows]
        qo_indptr = torch.tensor(qo, dtype=torch.int32, device=self._device)
        self._prefill.plan(
            qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, ps,
            causal=True, pos_encoding_mode="NONE", q_data_type=self._dtype,
            kv_data_type=self._dtype,
        )  # fmt: skip

    def attend(self, q: torch.Tensor, cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        wrapper = self._decode if self._decoding else self._prefill
        return wrapper.run(q.contiguous(), cache)


def make_attention(
    name: str, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any
) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        if torch.device(device).type != "cuda":
            raise ValueError(f"--attention flashinfer needs a CUDA device, got --device {device}")
        return FlashInferAttention(num_heads, kv_heads, head_dim, dtype, device)
    raise ValueError(f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")


def default_attention(device: Any) -> str:
    """FlashInfer on CUDA when it is installed, the torch path otherwise."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "torch"
    return "flashinfer"
