"""The torch paged path equals dense causal attention, and the runner's greedy output does not
depend on how the work is cut: chunked prefill, a reused prefix, batch 1 or batch 8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvbank.engine.model.attention import (
    TorchAttention,
    allocate_cache,
    build_paged_batch,
    write_kv,
)
from kvbank.engine.model.loader import load_model
from kvbank.engine.model.runner import TorchRunner
from tests.model.drive import PageCounter, Seq, generate

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 2, 8, 4


@pytest.mark.parametrize("split", [0, 5, 9])
def test_paged_attention_equals_dense_causal_attention(split: int) -> None:
    """A 13-token sequence written in two chunks at scattered pages attends exactly like a dense
    causal pass over the whole sequence (GQA: 4 query heads over 2 KV heads)."""
    torch.manual_seed(0)
    length = 13
    q = torch.randn(length, HEADS, HEAD_DIM)
    k = torch.randn(length, KV_HEADS, HEAD_DIM)
    v = torch.randn(length, KV_HEADS, HEAD_DIM)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0),
        v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0),
        is_causal=True,
    ).transpose(0, 1)

    (cache,) = allocate_cache(
        1, 16, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")
    )
    pages = [11, 3, 7, 14]
    backend = TorchAttention()
    outputs = []
    for lo, hi in ((0, split), (split, length)):
        if lo == hi:
            continue
        batch = build_paged_batch([(lo, hi - lo, pages)], PAGE_SIZE, torch.device("cpu"))
        write_kv(cache, k[lo:hi], v[lo:hi], batch)
        outputs.append(backend.attend(q[lo:hi], cache, batch))
    paged = torch.cat(outputs)
    assert torch.allclose(paged, dense, atol=1e-5), (paged - dense).abs().max()
    # Pages no row named stay untouched (zero): writes land only where the page table says.
    untouched = [p for p in range(16) if p not in pages]
    assert cache[untouched].abs().sum().item() == 0.0


def test_a_row_without_enough_pages_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="needs 3 pages of 4 tokens but was given 2"):
        build_paged_batch([(8, 2, [1, 2])], PAGE_SIZE, torch.device("cpu"))


PROMPTS = [
    [0, *range(40, 40 + n)] for n in (3, 9, 17, 4, 30, 12, 7, 21)
]  # eight prompts of different lengths


def _seqs(pages: PageCounter, prompts: list[list[int]], max_new: int) -> list[Seq]:
    size = builtin_runner_page_size()
    return [
        Seq(f"r{i}", list(p), pages.take(-(-(len(p) + max_new) // size)))
        for i, p in enumerate(prompts)
    ]


def builtin_runner_page_size() -> int:
    return 4


@pytest.fixture(scope="module")
def runner(builtin_model_dir: Path) -> TorchRunner:
    model = load_model(builtin_model_dir, torch.device("cpu"))
    return TorchRunner(model, num_pages=512, page_size=builtin_runner_page_size(), eos_token_id=1)


def test_greedy_output_is_the_same_at_batch_1_and_batch_8(runner: TorchRunner) -> None:
    counter = PageCounter()
    alone = generate(runner, _seqs(counter, PROMPTS, 12), 12, together=False)
    together = generate(runner, _seqs(counter, PROMPTS, 12), 12, together=True)
    assert alone == together
    assert len({tuple(v) for v in alone.values()}) > 1  # the prompts lead somewhere different


@pytest.mark.parametrize("chunk", [1, 5, 8])
def test_greedy_output_is_the_same_with_chunked_prefill(runner: TorchRunner, chunk: int) -> None:
    counter = PageCounter()
    whole = generate(runner, _seqs(counter, PROMPTS[:4], 10), 10)
    chunked = generate(runner, _seqs(counter, PROMPTS[:4], 10), 10, chunk=chunk)
    assert whole == chunked


def test_greedy_output_is_the_same_when_the_prefix_comes_from_cache(runner: TorchRunner) -> None:
    """A second request reuses the first one's full prompt pages and computes only the rest."""
    counter = PageCounter()
    shared = [0, *range(100, 126)]  # 27 tokens: 6 full pages of 4
    first = Seq("first", [*shared, 7, 8], counter.take(12))
    generate(runner, [first], 4)
    prompt = [*shared, 9, 10, 11]
    cold = Seq("cold", prompt, counter.take(12))
    warm = Seq("warm", prompt, first.pages[:6] + counter.take(6), computed=24)
    assert generate(runner, [cold], 12) == {"cold": generate(runner, [warm], 12)["warm"]}


def test_a_padded_decode_batch_equals_rows_one_by_one() -> None:
    """Decode rows of different lengths run as one masked batch; each equals its own pass."""
    torch.manual_seed(1)
    device = torch.device("cpu")
    (cache,) = allocate_cache(1, 32, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, device)
    cache.normal_()
    rows = [(2, 1, [5]), (12, 1, [9, 3, 7, 30]), (7, 1, [11, 12])]
    q = torch.randn(len(rows), HEADS, HEAD_DIM)
    backend = TorchAttention()
    batch = build_paged_batch(rows, PAGE_SIZE, device)
    backend.plan(batch)
    together = backend.attend(q, cache, batch)
    for i, row in enumerate(rows):
        single = build_paged_batch([row], PAGE_SIZE, device)
        backend.plan(single)
        alone = backend.attend(q[i : i + 1], cache, single)
        assert torch.allclose(together[i], alone[0], atol=1e-6)
