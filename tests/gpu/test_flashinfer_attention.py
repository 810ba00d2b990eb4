"""FlashInfer's paged kernels read the same pages as the torch path and agree with it (CUDA only;
skipped on CPU and where flashinfer is not installed)."""

from __future__ import annotations

import pytest
import torch

from kvbank.engine.model.attention import (
    FlashInferAttention,
    TorchAttention,
    allocate_cache,
    build_paged_batch,
    write_kv,
)

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 32, 8, 128, 16, 256
# bf16 inputs, float32 accumulation in both paths: differences stay at bf16 rounding of O(1)
# outputs.
TOLERANCE = 3e-2


def _needs_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flashinfer")


def _compare(rows: list[tuple[int, int, list[int]]]) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    (cache,) = allocate_cache(1, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    cache.normal_()  # earlier positions of every row: random "history" already in the pages
    batch = build_paged_batch(rows, PAGE_SIZE, device)
    tokens = batch.positions.shape[0]
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    write_kv(cache, k, v, batch)
    torch_path = TorchAttention()
    torch_path.plan(batch)  # a decode-only batch takes the padded, masked batch path
    reference = torch_path.attend(q, cache, batch)
    flash = FlashInferAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    flash.plan(batch)
    out = flash.attend(q, cache, batch)
    diff = (out.float() - reference.float()).abs().max().item()
    assert diff <= TOLERANCE, f"flashinfer differs from the torch path by {diff}"


def test_decode_batch_matches_the_torch_path() -> None:
    _needs_flashinfer()
    rows = [(pos, 1, list(range(1 + 8 * i, 9 + 8 * i))[::-1]) for i, pos in
            enumerate([0, 15, 16, 17, 100, 127])]  # fmt: skip
    _compare(rows)


def test_mixed_prefill_and_decode_batch_matches_the_torch_path() -> None:
    _needs_flashinfer()
    rows = [
        (0, 37, list(range(1, 4))),  # a fresh prompt over three pages
        (48, 20, list(range(10, 15))),  # a later chunk of a prompt: attends to its history
        (90, 1, list(range(20, 26))),  # a decode row in the same batch
    ]
    _compare(rows)
