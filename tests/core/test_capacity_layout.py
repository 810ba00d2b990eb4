"""The pool vLLM makes of a model's layout on one rank, and count_pages over its groups: each
group is a label with its own worst-case rule; pools without a layout count as before."""

from pathlib import Path

import pytest

from kvbank.capacity import (
    CapacityModel,
    RequestShape,
    count_pages,
    label_growth,
    page_bytes,
    worst_case,
)
from kvbank.capacity.hfconfig import read_layout
from kvbank.capacity.layout import EngineSettings, LayoutError, pool_layout
from kvbank.model_spec import PRESETS
from kvbank.modelpool import KvSlot, parse_modelpool

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def pool_of(name: str, **settings: object):  # type: ignore[no-untyped-def]
    return pool_layout(read_layout(CONFIGS / f"{name}.json"), EngineSettings(**settings))  # type: ignore[arg-type]


# ---- page bytes and groups -----------------------------------------------------------------


def preset_pool(preset: str, tp: int):  # type: ignore[no-untyped-def]
    return parse_modelpool({
        "apiVersion": "kvbank.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "p"},
        "spec": {
            "model": {"name": "m", "architecture": {"preset": preset}}, "tensorParallel": tp,
            "gpu": {"memoryGiB": 80}, "kv": {"pageSize": 16, "pages": 1000},
            "kvSlots": {"main": {"prompt": 1, "output": 1}},
            "limits": {"maxSeqLen": 8192, "maxTokens": 1024},
        },
    })  # fmt: skip


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("llama-3.1-8b", "llama-3.1-8b"),
        ("llama-3.1-70b", "llama-3.1-70b"),
        ("qwen3-8b", "qwen3-8b"),
    ],
)
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_full_attention_config_pools_as_its_preset(name: str, preset: str, tp: int) -> None:
    layout = pool_of(name, tensor_parallel=tp)
    assert [g.label for g in layout.groups] == ["full"]
    assert layout.page_bytes == page_bytes(preset_pool(preset, tp))
    assert PRESETS[preset].layers == layout.layers_per_group


def test_gpt_oss_pools_two_groups_of_twelve_layers() -> None:
    layout = pool_of("gpt-oss-20b")
    # 8 KV heads x (64 + 64) x 2 bytes a token, 16 tokens a page, 12 layers a group
    assert (layout.layer_page_bytes, layout.layers_per_group) == (32768, 12)
    assert layout.page_bytes == 393216
    assert [(g.label, g.layers, g.cap_pages) for g in layout.groups] == [
        ("sliding", 12, 1033),  # ceil((128 - 1 + 2 x 8192) / 16) + 1: two steps in flight
        ("full", 12, None),
    ]
    assert pool_of("gpt-oss-20b", max_num_batched_tokens=2048).groups[0].cap_pages == 265
    # without async scheduling one step is in flight
    assert pool_of("gpt-oss-20b", batches_in_flight=1).groups[0].cap_pages == 521
    one = pool_of("gpt-oss-20b", max_num_batched_tokens=2048, batches_in_flight=1)
    assert one.groups[0].cap_pages == 137


def test_gpt_oss_at_tp8_keeps_one_kv_head_a_rank_and_fp8_halves_the_page() -> None:
    assert pool_of("gpt-oss-20b", tensor_parallel=8).page_bytes == 393216 // 8
    assert pool_of("gpt-oss-20b", kv_dtype="fp8").page_bytes == 393216 // 2
    # per-token-head scales: one float32 per token, head and K/V on top
    scaled = pool_of("gpt-oss-20b", kv_dtype="fp8_per_token_head")
    assert scaled.layer_page_bytes == 16 * (8 * 128 * 1 + 2 * 8 * 4)


def test_gemma3_splits_its_sliding_layers_into_groups_the_size_of_its_full_ones() -> None:
    layout = pool_of("gemma-3-27b")
    assert layout.layers_per_group == 10
    assert [g.label for g in layout.groups] == [f"sliding.{i}" for i in range(6)] + ["full"]
    assert sum(g.layers for g in layout.groups) == 62  # 52 sliding dealt over 6 groups, 10 full
    assert layout.page_bytes == 10 * 16 * 16 * 256 * 2


def test_mla_keeps_one_latent_per_token_whatever_the_tp() -> None:
    for tp in (1, 8):
        layout = pool_of("deepseek-v3", tensor_parallel=tp)
        assert layout.page_bytes == 61 * 16 * 576 * 2
        assert layout.kv_heads_per_rank == 1


def test_llama4_pools_its_chunked_layers_as_full_attention_by_default() -> None:
    # vLLM turns its hybrid allocator off for a model with an attention chunk: every layer in
    # one group of every position
    layout = pool_of("llama-4-scout", tensor_parallel=8)
    assert [(g.label, g.layers, g.cap_pages) for g in layout.groups] == [("full", 48, None)]
    assert layout.layers_per_group == 48
    assert layout.page_bytes == 48 * 16 * 1 * 256 * 2


def test_llama4_chunks_count_the_chunk_and_the_steps_with_the_hybrid_allocator() -> None:
    layout = pool_of("llama-4-scout", tensor_parallel=8, hybrid_chunked_local=True)
    assert [g.label for g in layout.groups] == ["chunked.0", "chunked.1", "chunked.2", "full"]
    assert layout.groups[0].cap_pages == (8192 + 2 * 8192) // 16  # the chunk, two steps


@pytest.mark.parametrize(
    ("tp", "page_size"),
    [(1, 544), (2, 544), (8, 144)],  # TP 2 halves the state and the KV heads alike
)
def test_qwen3_next_raises_the_page_so_a_state_fits_one(tp: int, page_size: int) -> None:
    layout = pool_of("qwen3-next-80b-a3b", tensor_parallel=tp)
    state = (8192 // tp * 3 + 32 // tp * 128 * 128) * 2
    assert layout.page_size == page_size
    assert layout.layer_page_bytes >= state
    assert layout.layer_page_bytes - state < 16 * layout.layer_page_bytes // page_size
    assert [g.state_pages for g in layout.groups] == [1, 1, 1, 0]


def test_jamba_state_pages_and_speculative_blocks() -> None:
    layout = pool_of("jamba-v0.1", speculative_tokens=2)
    assert layout.page_size == 80  # 311296 state bytes over 4096 bytes a token, to 16s
    # vLLM raises a block size asked for in steps of itself: 76 tokens to 32s
    assert pool_of("jamba-v0.1", page_size=32).page_size == 96
    assert [g.state_pages for g in layout.groups] == [3] * 7 + [0]


@pytest.mark.parametrize(
    ("name", "tp", "words"),
    [
        ("llama-3.1-8b", 3, "3 does not divide the model's 32 attention heads"),
        ("gpt-oss-20b", 5, "does not divide"),
        ("qwen3-8b", 64, "64 does not divide"),
    ],
)
def test_a_tp_the_heads_cannot_split_names_tensor_parallel(name: str, tp: int, words: str) -> None:
    with pytest.raises(LayoutError) as caught:
        pool_of(name, tensor_parallel=tp)
    assert caught.value.field == "tensorParallel"
    assert words in str(caught.value)


def test_kv_heads_are_copied_when_tp_exceeds_them() -> None:
    assert pool_of("qwen3-30b-a3b", tensor_parallel=8).kv_heads_per_rank == 1  # 4 KV heads
    assert pool_of("qwen3-next-80b-a3b", tensor_parallel=4).kv_heads_per_rank == 1  # 2 KV heads


# ---- count_pages over the groups -----------------------------------------------------------


def test_a_sliding_group_holds_its_window_and_the_steps_in_flight_at_most() -> None:
    model = pool_of("gpt-oss-20b", max_num_batched_tokens=2048).capacity_model(8192, 2048)
    count = count_pages(model, RequestShape(6144, 2048))
    assert count.per_label == {"sliding": 265, "full": 512}
    short = count_pages(model, RequestShape(100, 50))
    assert short.per_label == {"sliding": 10, "full": 10}  # below the window: every position
    assert worst_case(model)[1].total == 777


def test_a_state_group_holds_its_pages_whatever_the_length() -> None:
    model = pool_of("jamba-v0.1").capacity_model(32768, 1024)
    for prompt in (1, 5000, 32000):
        count = count_pages(model, RequestShape(prompt, 100))
        assert all(count.per_label[f"mamba.{i}"] == 1 for i in range(7))


def test_a_capped_label_grows_until_its_cap() -> None:
    model = pool_of("gpt-oss-20b", max_num_batched_tokens=2048).capacity_model(8192, 4096)
    request = RequestShape(1000, 4096)
    growth, count = label_growth(model, request)
    assert growth["sliding"].base == 1000
    assert growth["sliding"].worst == 265 * 16
    assert growth["full"].base == 1000 and growth["full"].worst == 5096
    assert count.per_label["sliding"] == 265


def test_sequences_share_nothing_where_a_window_drops_the_prompt() -> None:
    model = pool_of("gpt-oss-20b", max_num_batched_tokens=2048).capacity_model(8192, 1024)
    one = count_pages(model, RequestShape(4000, 1024))
    three = count_pages(model, RequestShape(4000, 1024, sequences=3))
    assert three.per_label == {k: 3 * v for k, v in one.per_label.items()}


def test_caps_leave_a_model_without_them_as_it_was() -> None:
    slots = {"main": KvSlot(1, 1), "vision": KvSlot(0, 0, 576)}
    plain = CapacityModel(slots, 16, 8192, 1024, 1)
    capped = CapacityModel(slots, 16, 8192, 1024, 1, label_caps={"other": 3})
    request = RequestShape(3000, 500, sequences=2)
    assert count_pages(plain, request) == count_pages(CapacityModel(slots, 16, 8192, 1024, 1),
                                                      request)  # fmt: skip
    assert count_pages(capped, RequestShape(3000, 500)) == count_pages(
        plain, RequestShape(3000, 500)
    )


@pytest.mark.parametrize("page", [1, 7, 16])
def test_the_worst_case_with_caps_is_the_brute_force_maximum(page: int) -> None:
    slots = {"a": KvSlot(1, 1), "b": KvSlot(2, 1), "c": KvSlot(1, 3, 5)}
    model = CapacityModel(slots, page, 300, 200, 1, label_caps={"b": 20, "c": 31})
    best = max(count_pages(model, RequestShape(p, 300 - p)).total for p in range(100, 300))
    assert worst_case(model)[1].total == best
