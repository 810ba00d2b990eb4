"""kvbank's pool layout against vLLM's own KV cache code, in vLLM's environment (.venv-vllm).

For each config in tests/data/configs, across TP 1/2/8 and bf16/fp8, the per-layer specs are
made with vLLM's spec classes (and vLLM's Mamba state shapes), then grouped, pooled and counted
by vLLM's kv_cache_utils with the same memory and no weights. kvbank's figures must agree: page
bytes (the same budget gives the same block count), the groups, each group's worst-case blocks
per request, and the concurrency. The layer kinds come from kvbank's reader (checked against
transformers in tests/core/test_capacity_config.py); what this pins is the pooling arithmetic.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvbank.capacity import worst_case
from kvbank.capacity.hfconfig import Kind, LayerGroup, ModelLayout, read_layout
from kvbank.capacity.layout import EngineSettings, LayoutError, PoolLayout, pool_layout

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn}


def vllm_config(max_model_len: int, max_num_batched_tokens: int) -> Any:
    """The fields kv_cache_utils reads, and nothing a model would need."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens,
            disable_hybrid_kv_cache_manager=False,
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        cache_config=SimpleNamespace(mamba_cache_mode="none", num_gpu_blocks_override=None),
    )


def state_shapes(group: LayerGroup, tp: int, spec: int) -> tuple[tuple[int, ...], ...]:
    s = dict(group.state)
    calc = MambaStateShapeCalculator
    if group.kind is Kind.MAMBA:
        return calc.mamba1_state_shape(tp, s["intermediate"], s["d_state"], s["d_conv"])
    if group.kind is Kind.MAMBA2:
        return calc.mamba2_state_shape(
            tp, s["intermediate"], s["n_groups"], s["n_heads"], s["head_dim"], s["d_state"],
            s["d_conv"], spec,
        )  # fmt: skip
    return calc.gated_delta_net_state_shape(
        tp, s["key_heads"], s["value_heads"], s["key_dim"], s["value_dim"], s["conv_kernel"],
        spec,
    )  # fmt: skip


def layer_specs(model: ModelLayout, pool: PoolLayout, max_model_len: int) -> dict[str, Any]:
    settings = pool.settings
    dtype = TORCH_DTYPES[settings.kv_dtype]
    state_dtype = TORCH_DTYPES[model.weights_dtype]
    heads = pool.kv_heads_per_rank
    block = pool.page_size
    specs: dict[str, Any] = {}
    for group in model.groups:
        for index in range(group.layers):
            name = f"{group.kind.value}.{index}"
            common = {"block_size": block, "num_kv_heads": heads, "dtype": dtype}
            if group.kind is Kind.FULL:
                specs[name] = FullAttentionSpec(head_size=group.head_dim_k, **common)
            elif group.kind is Kind.SLIDING:
                specs[name] = SlidingWindowSpec(
                    head_size=group.head_dim_k, sliding_window=group.window, **common
                )
            elif group.kind is Kind.CHUNKED:
                specs[name] = ChunkedLocalAttentionSpec(
                    head_size=group.head_dim_k, attention_chunk_size=group.window, **common
                )
            elif group.kind is Kind.MLA:
                specs[name] = MLAAttentionSpec(
                    block_size=block, num_kv_heads=1, head_size=group.head_dim_k, dtype=dtype
                )
            else:
                shapes = state_shapes(group, settings.tensor_parallel, settings.speculative_tokens)
                raw = MambaSpec(
                    block_size=max_model_len, shapes=shapes, dtypes=(state_dtype,) * len(shapes)
                )
                assert raw.page_size_bytes <= pool.layer_page_bytes  # vLLM's own invariant
                specs[name] = MambaSpec(
                    block_size=max_model_len,
                    shapes=shapes,
                    dtypes=(state_dtype,) * len(shapes),
                    page_size_padded=pool.layer_page_bytes,
                    num_speculative_blocks=settings.speculative_tokens,
                )
    return specs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


CASES = [(name, tp, dtype) for name in NAMES for tp in (1, 2, 8) for dtype in ("bfloat16", "fp8")]


@pytest.mark.parametrize(("name", "tp", "kv_dtype"), CASES)
@pytest.mark.parametrize(("max_model_len", "batched"), [(32768, 8192), (8192, 2048)])
def test_pages_groups_blocks_and_concurrency_agree_with_vllm(
    name: str, tp: int, kv_dtype: str, max_model_len: int, batched: int
) -> None:
    model = read_layout(CONFIGS / f"{name}.json")
    settings = EngineSettings(16, tp, kv_dtype, batched, 0)
    try:
        pool = pool_layout(model, settings)
    except LayoutError:
        pytest.skip(f"{name} does not split over TP {tp}")
    config = vllm_config(max_model_len, batched)
    groups = get_kv_cache_groups(config, layer_specs(model, pool, max_model_len))

    # the groups: as many, of the same kinds, with the same layers per group
    assert len(groups) == len(pool.groups)
    assert max(len(g.layer_names) for g in groups) == pool.layers_per_group

    # page bytes: a budget of exactly N of kvbank's pages is N of vLLM's blocks, one byte less
    # is one block fewer
    pages = 5000
    exact = get_kv_cache_config_from_groups(config, groups, pages * pool.page_bytes)
    short = get_kv_cache_config_from_groups(config, groups, pages * pool.page_bytes - 1)
    assert (exact.num_blocks, short.num_blocks) == (pages, pages - 1)

    # worst-case blocks per request, group by group (in the order both make them)
    capacity = pool.capacity_model(max_model_len, max_model_len - 1)
    _, worst = worst_case(capacity)
    vllm_blocks = []
    for group, ours in zip(groups, pool.groups, strict=True):
        spec = group.kv_cache_spec
        theirs = cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
        vllm_blocks.append(theirs)
        # vLLM's estimate adds a page to a window even when the request is shorter than it;
        # no group ever holds more than every position, which is what kvbank counts there
        every_position = cdiv(max_model_len, pool.page_size)
        expected = theirs if ours.state_pages else min(theirs, every_position)
        assert worst.per_label[ours.label] == expected, ours.label

    # concurrency: vLLM's figure over the same blocks; kvbank keeps one sink page back and
    # never counts more blocks a request than vLLM's estimate
    concurrency = get_max_concurrency_for_kv_cache_config(config, exact)
    assert concurrency == pytest.approx(pages / sum(vllm_blocks))
    assert worst.total <= sum(vllm_blocks)
    assert (pages - 1) // worst.total >= (pages - 1) // sum(vllm_blocks)
