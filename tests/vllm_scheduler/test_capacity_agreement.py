"""kvbank's pool layout against vLLM's own KV cache code, in vLLM's environment (.venv-vllm).

For each config in tests/data/configs, across TP 1/2/8 and bf16/fp8, the per-layer specs are
made with vLLM's spec classes (and vLLM's Mamba state shapes and dtypes), then grouped, pooled
and counted by vLLM's planner (`vllm/v1/core/kv_cache_planning.py`: get_global_kv_cache_groups,
get_kv_cache_configs; `kv_cache_utils.get_max_concurrency_for_kv_cache_config`) with the same
memory and no weights. The engine settings are what a plain `vllm serve` resolves them to on a
CUDA GPU: async scheduling on (two batches in flight), the hybrid KV cache manager on except
for chunked local attention (VllmConfig.__post_init__ turns it off there), FlashAttention's
first KV layout (LBNHC). kvbank's figures must agree: page bytes (the same budget gives the
same block count), the groups, each group's worst-case blocks per request, and the
concurrency. The layer kinds come from kvbank's reader (checked against transformers in
tests/core/test_capacity_config.py); what this pins is the pooling arithmetic.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import AttentionConfig, CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvbank.capacity import worst_case
from kvbank.capacity.hfconfig import Kind, LayerGroup, ModelLayout, read_layout
from kvbank.capacity.layout import (
    PAGE_ALIGNMENT,
    EngineSettings,
    LayoutError,
    PoolLayout,
    pool_layout,
)

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn}


class EngineConfig(SimpleNamespace):
    """The parts of a VllmConfig the planner reads, built from vLLM's real sub-configs; the
    in-flight arithmetic is VllmConfig's own (its properties, run on this object)."""

    max_concurrent_batches = VllmConfig.max_concurrent_batches
    max_in_flight_tokens = VllmConfig.max_in_flight_tokens
    num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens
    use_v2_model_runner = False


def has_chunks(model: ModelLayout) -> bool:
    return any(g.kind is Kind.CHUNKED for g in model.groups)


def vllm_config(model: ModelLayout, settings: EngineSettings, max_model_len: int) -> Any:
    cache = CacheConfig()
    cache.kv_cache_layout = "LBNHC"  # FlashAttention declares none: vLLM's default preference
    scheduler = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        is_encoder_decoder=False,
        # True is what VllmConfig resolves `None` to with the default executor: two batches in
        # flight (VllmConfig.max_concurrent_batches); --no-async-scheduling, one
        async_scheduling=settings.batches_in_flight == 2,
        # VllmConfig turns the hybrid manager off for a model with an attention chunk unless
        # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE is set
        disable_hybrid_kv_cache_manager=has_chunks(model) and not settings.hybrid_chunked_local,
    )
    return EngineConfig(
        model_config=SimpleNamespace(
            max_model_len=max_model_len,
            original_max_model_len=max_model_len,
            supports_kv_cache_grouping=False,
        ),
        scheduler_config=scheduler,
        parallel_config=ParallelConfig(tensor_parallel_size=settings.tensor_parallel),
        cache_config=cache,
        attention_config=AttentionConfig(),
        speculative_config=None,
    )


def state_spec(group: LayerGroup, model: ModelLayout, tp: int, spec: int) -> MambaSpec:
    """A state layer's spec before padding, as vLLM's model classes make it."""
    s = dict(group.state)
    shapes: tuple[tuple[int, ...], ...]
    shape, dtype = MambaStateShapeCalculator, MambaStateDtypeCalculator
    model_dtype = TORCH_DTYPES[model.weights_dtype]
    if group.kind is Kind.MAMBA:
        shapes = shape.mamba1_state_shape(tp, s["intermediate"], s["d_state"], s["d_conv"])
        dtypes = dtype.mamba1_state_dtype(model_dtype, "auto", "auto")
    elif group.kind is Kind.MAMBA2:
        shapes = shape.mamba2_state_shape(
            tp, s["intermediate"], s["n_groups"], s["n_heads"], s["head_dim"], s["d_state"],
            s["d_conv"], spec,
        )  # fmt: skip
        dtypes = dtype.mamba2_state_dtype(model_dtype, "auto", "auto")
    else:
        shapes = shape.gated_delta_net_state_shape(
            tp, s["key_heads"], s["value_heads"], s["key_dim"], s["value_dim"],
            s["conv_kernel"], spec,
        )  # fmt: skip
        dtypes = dtype.gated_delta_net_state_dtype(model_dtype, "auto", "auto")
    return MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes, num_speculative_blocks=spec)


def attention_spec(group: LayerGroup, pool: PoolLayout, block: int) -> KVCacheSpec:
    dtype = TORCH_DTYPES[pool.settings.kv_dtype]
    if group.kind is Kind.MLA:
        return MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=group.head_dim_k, dtype=dtype
        )
    common: dict[str, Any] = {
        "block_size": block,
        "num_kv_heads": pool.kv_heads_per_rank,
        "head_size": group.head_dim_k,
        "head_size_v": group.head_dim_v,
        "dtype": dtype,
    }
    if group.kind is Kind.SLIDING:
        return SlidingWindowSpec(sliding_window=group.window, **common)
    if group.kind is Kind.CHUNKED:
        return ChunkedLocalAttentionSpec(attention_chunk_size=group.window, **common)
    return FullAttentionSpec(**common)


def layer_specs(model: ModelLayout, pool: PoolLayout) -> dict[str, KVCacheSpec]:
    """Every layer's spec at kvbank's block size, a state padded to an attention page."""
    settings = pool.settings
    tp, spec = settings.tensor_parallel, settings.speculative_tokens
    first = next(g for g in model.groups if not g.kind.is_state)
    attention_page = attention_spec(first, pool, pool.page_size).page_size_bytes
    specs: dict[str, KVCacheSpec] = {}
    for group in model.groups:
        for index in range(group.layers):
            name = f"{group.kind.value}.{index}"
            if not group.kind.is_state:
                specs[name] = attention_spec(group, pool, pool.page_size)
                continue
            raw = state_spec(group, model, tp, spec)
            # vLLM's block size for a hybrid (Platform._align_hybrid_block_size): the fewest
            # steps of max(the smallest kernel block, 16 tokens for FlashAttention; the block
            # size asked for) whose attention page holds the state; the state page is then
            # padded to it
            step = max(PAGE_ALIGNMENT, settings.page_size)
            assert raw.page_size_bytes <= attention_page
            if pool.page_size != settings.page_size:
                assert pool.page_size % step == 0
                smaller = attention_spec(first, pool, pool.page_size - step)
                assert raw.page_size_bytes > smaller.page_size_bytes
            specs[name] = MambaSpec(
                block_size=pool.page_size,
                shapes=raw.shapes,
                dtypes=raw.dtypes,
                page_size_padded=attention_page,
                num_speculative_blocks=spec,
            )
    return specs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_kinds(spec: KVCacheSpec) -> set[str]:
    inner = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    kinds = set()
    for one in inner:
        if isinstance(one, MambaSpec):
            kinds.add("state")
        elif isinstance(one, MLAAttentionSpec):
            kinds.add(Kind.MLA.value)
        elif isinstance(one, SlidingWindowSpec):
            kinds.add(Kind.SLIDING.value)
        elif isinstance(one, ChunkedLocalAttentionSpec):
            kinds.add(Kind.CHUNKED.value)
        else:
            kinds.add(Kind.FULL.value)
    return kinds


def windows(model: ModelLayout) -> bool:
    return any(g.kind in (Kind.SLIDING, Kind.CHUNKED) for g in model.groups)


def engines(name: str) -> list[tuple[int, bool, int]]:
    """(block size, hybrid_chunked_local, batches_in_flight) to try: the default serve; for a
    model with a window or a chunk also without async scheduling; for one with a chunk also
    with the hybrid allocator allowed (the env variable); for one with a state also with
    --block-size 32, which the state raises in steps of 32."""
    model = read_layout(CONFIGS / f"{name}.json")
    found = [(16, False, 2)]
    if windows(model):
        found.append((16, False, 1))
    if has_chunks(model):
        found.append((16, True, 2))
    if any(g.kind.is_state for g in model.groups):
        found.append((32, False, 2))
    return found


CASES = [
    (name, tp, dtype, page, hybrid, batches)
    for name in NAMES
    for tp in (1, 2, 8)
    for dtype in ("bfloat16", "fp8")
    for page, hybrid, batches in engines(name)
]


@pytest.mark.parametrize(("name", "tp", "kv_dtype", "page", "hybrid_chunked", "batches"), CASES)
@pytest.mark.parametrize(("max_model_len", "batched"), [(32768, 8192), (8192, 2048)])
def test_pages_groups_blocks_and_concurrency_agree_with_vllm(
    name: str,
    tp: int,
    kv_dtype: str,
    page: int,
    hybrid_chunked: bool,
    batches: int,
    max_model_len: int,
    batched: int,
) -> None:
    model = read_layout(CONFIGS / f"{name}.json")
    settings = EngineSettings(
        page, tp, kv_dtype, batched, 0, batches_in_flight=batches,
        hybrid_chunked_local=hybrid_chunked,
    )  # fmt: skip
    try:
        pool = pool_layout(model, settings)
    except LayoutError:
        pytest.skip(f"{name} does not split over TP {tp}")
    config = vllm_config(model, settings, max_model_len)
    specs = layer_specs(model, pool)
    groups = get_global_kv_cache_groups(config, [dict(specs)])

    # the groups: as many, of the same kinds in the same order, as many layers in each
    assert len(groups) == len(pool.groups)
    for group, ours in zip(groups, pool.groups, strict=True):
        kind = "state" if ours.kind.is_state else ours.kind.value
        assert group_kinds(group.kv_cache_spec) == {kind}, ours.label
        assert len(group.layer_names) == ours.layers, ours.label
    assert max(len(g.layer_names) for g in groups) == pool.layers_per_group

    # page bytes: a budget of exactly N of kvbank's pages is N of vLLM's blocks, one byte less
    # is one block fewer (vLLM's own planning path, which also checks one request fits)
    pages = 100_000
    (exact,) = get_kv_cache_configs(config, [specs], [pages * pool.page_bytes], groups)
    (short,) = get_kv_cache_configs(config, [specs], [pages * pool.page_bytes - 1], groups)
    assert (exact.num_blocks, short.num_blocks) == (pages, pages - 1)

    # worst-case blocks per request, group by group (in the order both make them)
    capacity = pool.capacity_model(max_model_len, max_model_len - 1)
    _, worst = worst_case(capacity)
    vllm_blocks = []
    every_position = cdiv(max_model_len, pool.page_size)
    for group, ours in zip(groups, pool.groups, strict=True):
        spec = group.kv_cache_spec
        theirs = cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
        vllm_blocks.append(theirs)
        ours_blocks = worst.per_label[ours.label]
        if ours.state_pages or theirs <= every_position:
            assert ours_blocks == theirs, ours.label
        else:
            # the one expected difference (docs/modelpool.md, agreement with vLLM): where a
            # window and the tokens in flight cover the whole request, vLLM's estimate still
            # adds the page a window may start inside; what it reserves at run time,
            # min(ceil(tokens / block), that cap), is every position, as kvbank counts
            assert isinstance(spec, SlidingWindowSpec) or group_kinds(spec) == {"sliding"}
            assert (ours_blocks, theirs) == (every_position, every_position + 1), ours.label

    # concurrency: vLLM's figure over the same blocks; kvbank keeps one sink page back (vLLM's
    # null block, which get_kv_cache_configs reserved above) and never counts more blocks a
    # request than vLLM's estimate
    concurrency = get_max_concurrency_for_kv_cache_config(config, exact)
    assert concurrency == pytest.approx(pages / sum(vllm_blocks))
    assert worst.total <= sum(vllm_blocks)
    assert (pages - 1) // worst.total >= (pages - 1) // sum(vllm_blocks)
