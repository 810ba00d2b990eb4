"""A model's layout read from its config.json: the families people deploy, each group's kind
and size, the parameter estimate, and hostile files refused with one line naming the field."""

import json
from pathlib import Path
from typing import Any

import pytest

from kvbank.capacity.hfconfig import (
    MAX_CONFIG_BYTES,
    Kind,
    ModelConfigError,
    load_config,
    model_layout,
    parse_config_text,
    read_layout,
)

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def layout_of(name: str):  # type: ignore[no-untyped-def]
    return read_layout(CONFIGS / f"{name}.json")


def kinds(name: str) -> dict[str, int]:
    return {g.kind.value: g.layers for g in layout_of(name).groups}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-3.1-8b", {"full": 32}),
        ("llama-3.1-70b", {"full": 80}),
        ("qwen3-8b", {"full": 36}),
        ("qwen3-32b", {"full": 64}),
        ("qwen3-30b-a3b", {"full": 48}),
        ("mistral-7b-v0.1", {"sliding": 32}),
        ("gpt-oss-20b", {"sliding": 12, "full": 12}),
        ("gpt-oss-120b", {"sliding": 18, "full": 18}),
        ("gemma-3-27b", {"sliding": 52, "full": 10}),
        ("llama-4-scout", {"chunked": 36, "full": 12}),
        ("deepseek-v3", {"mla": 61}),
        ("qwen3-next-80b-a3b", {"linear": 36, "full": 12}),
        ("jamba-v0.1", {"mamba": 28, "full": 4}),
    ],
)
def test_each_family_reads_its_groups(name: str, expected: dict[str, int]) -> None:
    assert kinds(name) == expected


def test_windows_chunks_and_latents_are_the_configs() -> None:
    sliding = {g.kind: g for g in layout_of("gpt-oss-20b").groups}[Kind.SLIDING]
    assert (sliding.window, sliding.kv_heads, sliding.head_dim_k) == (128, 8, 64)
    assert {g.kind: g for g in layout_of("gemma-3-27b").groups}[Kind.SLIDING].window == 1024
    assert {g.kind: g for g in layout_of("llama-4-scout").groups}[Kind.CHUNKED].window == 8192
    (mla,) = layout_of("deepseek-v3").groups
    assert (mla.kv_heads, mla.head_dim_k, mla.head_dim_v) == (1, 512 + 64, 0)


def test_state_sizes_per_rank() -> None:
    linear = layout_of("qwen3-next-80b-a3b").groups[0]
    # conv: (2 x 16 x 128 + 32 x 128) channels x (kernel 4 - 1); state: 32 heads x 128 x 128
    assert linear.state_elements(1) == (8192 * 3, 32 * 128 * 128)
    assert linear.state_elements(8) == (1024 * 3, 4 * 128 * 128)
    # a speculative token keeps one more conv row (vLLM's num_spec), not more SSM state
    assert linear.state_elements(1, 2) == (8192 * 5, 32 * 128 * 128)
    mamba = layout_of("jamba-v0.1").groups[0]
    # Mamba-1: 2 x 4096 channels, d_conv 4, d_state 16
    assert mamba.state_elements(1) == (8192 * 3, 8192 * 16)


def test_a_mamba2_hybrid_reads_its_layer_types() -> None:
    # a made-up small hybrid in the granitemoehybrid schema, not a published model
    doc: dict[str, Any] = {
        "model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "hidden_size": 512, "mamba_n_heads": 16, "mamba_d_head": 64,
        "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4,
        "layer_types": ["mamba", "mamba", "mamba", "attention"],
    }  # fmt: skip
    layout = model_layout(doc)
    assert {g.kind: g.layers for g in layout.groups} == {Kind.MAMBA2: 3, Kind.FULL: 1}
    # conv: (1024 / tp + 2 x groups x 128) x 3; ssm: 16 / tp heads x 64 x 128
    assert layout.groups[0].state_elements(1) == ((1024 + 256) * 3, 16 * 64 * 128)
    assert layout.groups[0].state_elements(2) == ((512 + 256) * 3, 8 * 64 * 128)


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama-3.1-8b", 8.03),
        ("llama-3.1-70b", 70.6),
        ("qwen3-8b", 8.19),
        ("qwen3-32b", 32.8),
        ("qwen3-30b-a3b", 30.5),
        ("gpt-oss-20b", 20.9),
        ("gpt-oss-120b", 116.8),
        ("deepseek-v3", 671),
        ("qwen3-next-80b-a3b", 79.5),
        ("jamba-v0.1", 51.6),
        ("gemma-3-27b", 27.0),
        ("mistral-7b-v0.1", 7.24),
        ("llama-4-scout", 109),
    ],
)
def test_the_parameter_estimate_is_within_two_percent_of_the_published_count(
    name: str, billions: float
) -> None:
    estimate = layout_of(name).parameters / 1e9
    assert abs(estimate - billions) / billions < 0.02, estimate


def test_quantized_experts_are_counted_at_their_bits() -> None:
    # gpt-oss keeps its experts in MXFP4: its checkpoint is about 12.8 GiB, not 39 GiB
    assert 12.5 < layout_of("gpt-oss-20b").weight_bytes() / 2**30 < 13.5


# ---- against transformers' own reading of the same files (tests only; never at runtime) --


TRANSFORMERS_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
}


@pytest.mark.parametrize(
    ("name", "section"),
    [
        ("gpt-oss-20b", None),
        ("gpt-oss-120b", None),
        ("gemma-3-27b", "text_config"),
        ("llama-4-scout", "text_config"),
        ("qwen3-next-80b-a3b", None),
    ],
)
def test_layer_kinds_agree_with_transformers(name: str, section: str | None) -> None:
    transformers = pytest.importorskip("transformers")
    doc = json.loads((CONFIGS / f"{name}.json").read_text())
    doc = doc[section] if section else doc
    fields = {k: v for k, v in doc.items() if k != "model_type"}
    config = transformers.CONFIG_MAPPING[doc["model_type"]](**fields)
    counted: dict[str, int] = {}
    for kind in config.layer_types:
        counted[TRANSFORMERS_KINDS[kind]] = counted.get(TRANSFORMERS_KINDS[kind], 0) + 1
    assert kinds(name) == counted


def test_jamba_block_types_agree_with_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    doc = json.loads((CONFIGS / "jamba-v0.1.json").read_text())
    config = transformers.JambaConfig(**{k: v for k, v in doc.items() if k != "model_type"})
    assert kinds("jamba-v0.1") == {
        "mamba": config.layers_block_type.count("mamba"),
        "full": config.layers_block_type.count("attention"),
    }


# ---- hostile files -------------------------------------------------------------------------


def base() -> dict[str, Any]:
    return json.loads((CONFIGS / "llama-3.1-8b.json").read_text())


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"model_type": "gpt9"}, "model_type", "'gpt9' is not a family"),
        ({"model_type": None}, "model_type", "is missing"),
        ({"num_hidden_layers": -3}, "num_hidden_layers", "got -3"),
        ({"num_hidden_layers": 0}, "num_hidden_layers", "got 0"),
        ({"num_hidden_layers": True}, "num_hidden_layers", "must be an integer"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers", "must be an integer"),
        ({"num_attention_heads": 10**40}, "num_attention_heads", "must be from 1 to 1024"),
        ({"num_key_value_heads": 5}, "num_key_value_heads", "must divide"),
        ({"torch_dtype": "int4"}, "torch_dtype", "got 'int4'"),
        ({"hidden_size": 4.5}, "hidden_size", "must be an integer"),
        ({"sliding_window": -1, "model_type": "mistral"}, "sliding_window", "got -1"),
    ],
)
def test_a_bad_field_is_one_error_naming_it(change: dict[str, Any], field: str, words: str) -> None:
    doc = {**base(), **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ModelConfigError) as caught:
        model_layout(doc)
    assert caught.value.field == field
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_nested_fields_are_named_with_their_section() -> None:
    doc = json.loads((CONFIGS / "gemma-3-27b.json").read_text())
    doc["text_config"]["sliding_window_pattern"] = 0
    with pytest.raises(ModelConfigError) as caught:
        model_layout(doc)
    assert caught.value.field == "text_config.sliding_window_pattern"
    doc = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    doc["layer_types"][3] = "moe_attention"
    with pytest.raises(ModelConfigError) as caught:
        model_layout(doc)
    assert caught.value.field == "layer_types[3]"
    doc["layer_types"] = doc["layer_types"][:5]
    with pytest.raises(ModelConfigError, match="must list 24 layers, got 5 entries"):
        model_layout(doc)


def test_a_gemma3_without_its_text_config_is_refused() -> None:
    with pytest.raises(ModelConfigError) as caught:
        model_layout({"model_type": "gemma3"})
    assert caught.value.field == "text_config"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (b"[1, 2]", "must be a JSON object"),
        (b"{not json", "not valid JSON"),
        (b'{"num_hidden_layers": NaN}', "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b"[" * 100 + b"]" * 100, "nests deeper"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "config.json"),
        (b"\xff\xfe\x00", "not valid JSON"),
    ],
)
def test_files_that_are_not_a_config_are_refused_in_one_line(text: bytes, words: str) -> None:
    with pytest.raises(ModelConfigError) as caught:
        parse_config_text(text)
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_file_over_the_size_bound_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b" " * (MAX_CONFIG_BYTES + 10) + b"{}")
    with pytest.raises(ModelConfigError, match="over 1048576 bytes"):
        load_config(path)
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")
