"""A model's KV layout read from its Hugging Face `config.json`: which layers keep what, so the
capacity function counts the model people deploy rather than a hand-written shape. Each family's
reader takes the fields it needs through `ConfigFields` (kvbank/capacity/configfile.py), so a
bad file is one error naming the field. Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbank.capacity.configfile import (
    MAX_CONFIG_BYTES,
    MAX_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_WINDOW,
    ConfigFields,
    ModelConfigError,
    load_config,
    parse_config_text,
)
from kvbank.capacity.modellayout import WEIGHT_DTYPES, Kind, LayerGroup, ModelLayout
from kvbank.capacity.weights import parameter_estimate, weight_bits
from kvbank.fields import quote

__all__ = [  # re-exported: callers read configs through this module
    "MAX_CONFIG_BYTES",
    "Kind",
    "LayerGroup",
    "ModelConfigError",
    "ModelLayout",
    "load_config",
    "model_layout",
    "parse_config_text",
    "read_layout",
]


@dataclass(frozen=True)
class Attention:
    """The attention shape most families share."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


def _attention(f: ConfigFields) -> Attention:
    layers = f.integer("num_hidden_layers", 1, MAX_LAYERS)
    heads = f.integer("num_attention_heads", 1, MAX_HEADS)
    kv_heads = f.integer("num_key_value_heads", 1, MAX_HEADS, default=heads)
    hidden = f.integer("hidden_size", 1, MAX_DIM)
    if kv_heads > heads or heads % kv_heads:
        raise ModelConfigError(
            f.name("num_key_value_heads"),
            f"must divide num_attention_heads ({heads}), got {kv_heads}",
        )
    if f.has("head_dim"):
        head_dim = f.integer("head_dim", 1, MAX_DIM)
    elif hidden % heads:
        raise ModelConfigError(
            f.name("head_dim"),
            f"is missing and hidden_size ({hidden}) is not a multiple of num_attention_heads "
            f"({heads}); give head_dim",
        )
    else:
        head_dim = hidden // heads
    return Attention(layers, heads, kv_heads, head_dim, hidden)


def _group_runs(
    kinds: list[Kind], make: Callable[[Kind, int], LayerGroup]
) -> tuple[LayerGroup, ...]:
    """One group per kind, in order of first appearance, counting its layers."""
    counts: dict[Kind, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return tuple(make(kind, count) for kind, count in counts.items())


def _attention_groups(att: Attention, kinds: list[Kind], window: int) -> tuple[LayerGroup, ...]:
    def make(kind: Kind, count: int) -> LayerGroup:
        return LayerGroup(
            kind,
            count,
            att.kv_heads,
            att.head_dim,
            att.head_dim,
            window if kind in (Kind.SLIDING, Kind.CHUNKED) else 0,
        )

    return _group_runs(kinds, make)


def _window(f: ConfigFields, key: str = "sliding_window") -> int:
    return f.integer(key, 1, MAX_WINDOW)


def _layer_types(f: ConfigFields, layers: int, names: dict[str, Kind]) -> list[Kind] | None:
    listed = f.per_layer("layer_types", layers, tuple(names))
    return None if listed is None else [names[name] for name in listed]


ATTENTION_NAMES = {"full_attention": Kind.FULL, "sliding_attention": Kind.SLIDING}


def _dense_llama(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """llama, qwen2/qwen3 (+ MoE), mistral: full attention, or sliding where the config says
    (Mistral's sliding_window; Qwen's use_sliding_window from max_window_layers on)."""
    att = _attention(f)
    kinds = _layer_types(f, att.layers, ATTENTION_NAMES)
    if kinds is None:
        kinds = [Kind.FULL] * att.layers
        model_type = f.string("model_type")
        if model_type == "mistral" and f.has("sliding_window"):
            kinds = [Kind.SLIDING] * att.layers
        elif f.flag("use_sliding_window", False) and f.has("sliding_window"):
            first = f.integer("max_window_layers", 0, att.layers, default=0)
            kinds = [Kind.FULL] * first + [Kind.SLIDING] * (att.layers - first)
    window = _window(f) if Kind.SLIDING in kinds else 0
    return att, _attention_groups(att, kinds, window)


def _gpt_oss(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Alternating sliding and full attention, as `layer_types` lists them (sliding first)."""
    att = _attention(f)
    kinds = _layer_types(f, att.layers, ATTENTION_NAMES)
    if kinds is None:
        kinds = [Kind.SLIDING if i % 2 == 0 else Kind.FULL for i in range(att.layers)]
    window = _window(f) if Kind.SLIDING in kinds else 0
    return att, _attention_groups(att, kinds, window)


def _gemma3(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Sliding layers with one full layer every `sliding_window_pattern` (or `layer_types`)."""
    att = _attention(f)
    kinds = _layer_types(f, att.layers, ATTENTION_NAMES)
    if kinds is None:
        pattern = f.integer("sliding_window_pattern", 1, MAX_LAYERS, default=6)
        kinds = [Kind.FULL if (i + 1) % pattern == 0 else Kind.SLIDING for i in range(att.layers)]
    window = _window(f) if Kind.SLIDING in kinds else 0
    return att, _attention_groups(att, kinds, window)


def _llama4(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Chunked local attention on RoPE layers, full attention on the NoPE ones (`layer_types`,
    else `no_rope_layers`: 1 uses RoPE, 0 does not; else every `no_rope_layer_interval`-th
    layer is NoPE)."""
    att = _attention(f)
    chunk = f.integer("attention_chunk_size", 1, MAX_WINDOW) if f.has("attention_chunk_size") else 0
    names = {"full_attention": Kind.FULL, "chunked_attention": Kind.CHUNKED}
    listed = _layer_types(f, att.layers, names)
    if listed is not None:  # newer configs list the layers' kinds themselves
        if Kind.CHUNKED in listed and not chunk:
            raise ModelConfigError(
                f.name("attention_chunk_size"), "is missing; layer_types lists chunked layers"
            )
        return att, _attention_groups(att, listed, chunk)
    rope = f.per_layer("no_rope_layers", att.layers, (0, 1))
    if rope is None:
        interval = f.integer("no_rope_layer_interval", 1, MAX_LAYERS, default=4)
        rope = [int((i + 1) % interval != 0) for i in range(att.layers)]
    kinds = [Kind.CHUNKED if uses and chunk else Kind.FULL for uses in rope]
    return att, _attention_groups(att, kinds, chunk)


def _deepseek(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Multi-head latent attention: each layer keeps one latent of kv_lora_rank plus the shared
    RoPE key of qk_rope_head_dim per token, the same on every rank."""
    att = _attention(f)
    rank = f.integer("kv_lora_rank", 1, MAX_DIM)
    rope = f.integer("qk_rope_head_dim", 1, MAX_DIM)
    return att, (LayerGroup(Kind.MLA, att.layers, 1, rank + rope, 0),)


def _qwen3_next(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Gated delta net linear attention with full attention every `full_attention_interval`-th
    layer (or as `layer_types` lists)."""
    att = _attention(f)
    names = {"full_attention": Kind.FULL, "linear_attention": Kind.LINEAR}
    kinds = _layer_types(f, att.layers, names)
    if kinds is None:
        interval = f.integer("full_attention_interval", 1, MAX_LAYERS, default=4)
        kinds = [Kind.FULL if (i + 1) % interval == 0 else Kind.LINEAR for i in range(att.layers)]
    state = (
        ("key_heads", f.integer("linear_num_key_heads", 1, MAX_HEADS)),
        ("value_heads", f.integer("linear_num_value_heads", 1, MAX_HEADS)),
        ("key_dim", f.integer("linear_key_head_dim", 1, MAX_DIM)),
        ("value_dim", f.integer("linear_value_head_dim", 1, MAX_DIM)),
        ("conv_kernel", f.integer("linear_conv_kernel_dim", 2, 64)),
    )

    def make(kind: Kind, count: int) -> LayerGroup:
        if kind is Kind.LINEAR:
            return LayerGroup(kind, count, state=state)
        return LayerGroup(kind, count, att.kv_heads, att.head_dim, att.head_dim)

    return att, _group_runs(kinds, make)


def _jamba(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Mamba-1 layers with attention every `attn_layer_period` from `attn_layer_offset`
    (or as `layers_block_type` lists)."""
    att = _attention(f)
    names = {"attention": Kind.FULL, "mamba": Kind.MAMBA}
    listed = f.per_layer("layers_block_type", att.layers, tuple(names))
    if listed is not None:
        kinds = [names[name] for name in listed]
    else:
        period = f.integer("attn_layer_period", 1, MAX_LAYERS, default=8)
        offset = f.integer("attn_layer_offset", 0, MAX_LAYERS, default=4)
        kinds = [Kind.FULL if i % period == offset else Kind.MAMBA for i in range(att.layers)]
    expand = f.integer("mamba_expand", 1, 64, default=2)
    state = (
        ("intermediate", expand * att.hidden),
        ("d_state", f.integer("mamba_d_state", 1, 4096, default=16)),
        ("d_conv", f.integer("mamba_d_conv", 2, 64, default=4)),
    )
    return att, _hybrid_groups(att, kinds, state)


def _granite_hybrid(f: ConfigFields) -> tuple[Attention, tuple[LayerGroup, ...]]:
    """Mamba-2 layers with attention where `layer_types` says `attention`."""
    att = _attention(f)
    names = {"attention": Kind.FULL, "mamba": Kind.MAMBA2}
    listed = f.per_layer("layer_types", att.layers, tuple(names))
    if listed is None:
        raise ModelConfigError(f.name("layer_types"), "is missing; list each layer's type")
    kinds = [names[name] for name in listed]
    expand = f.integer("mamba_expand", 1, 64, default=2)
    n_heads = f.integer("mamba_n_heads", 1, MAX_HEADS)
    head_dim = f.integer("mamba_d_head", 1, MAX_DIM)
    if n_heads * head_dim != expand * att.hidden:
        raise ModelConfigError(
            f.name("mamba_n_heads"),
            f"x mamba_d_head ({n_heads} x {head_dim}) must equal mamba_expand x hidden_size "
            f"({expand} x {att.hidden})",
        )
    state = (
        ("intermediate", expand * att.hidden),
        ("d_state", f.integer("mamba_d_state", 1, 4096)),
        ("d_conv", f.integer("mamba_d_conv", 2, 64, default=4)),
        ("n_groups", f.integer("mamba_n_groups", 1, MAX_HEADS, default=1)),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
    )
    return att, _hybrid_groups(att, kinds, state)


def _hybrid_groups(
    att: Attention, kinds: list[Kind], state: tuple[tuple[str, int], ...]
) -> tuple[LayerGroup, ...]:
    def make(kind: Kind, count: int) -> LayerGroup:
        if kind.is_state:
            return LayerGroup(kind, count, state=state)
        return LayerGroup(kind, count, att.kv_heads, att.head_dim, att.head_dim)

    return _group_runs(kinds, make)


FAMILIES: dict[str, Callable[[ConfigFields], tuple[Attention, tuple[LayerGroup, ...]]]] = {
    "llama": _dense_llama,
    "mistral": _dense_llama,
    "qwen2": _dense_llama,
    "qwen3": _dense_llama,
    "qwen3_moe": _dense_llama,
    "gpt_oss": _gpt_oss,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "deepseek_v3": _deepseek,
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
    "granitemoehybrid": _granite_hybrid,
}
# Families whose decoder settings sit under `text_config` (a multimodal wrapper's config).
NESTED = ("gemma3", "llama4")


def model_layout(doc: Mapping[str, Any]) -> ModelLayout:
    """The layout of the model a config.json describes; ModelConfigError names the field."""
    top = ConfigFields(doc)
    model_type = top.string("model_type")
    if model_type is None:
        raise ModelConfigError("model_type", f"is missing; known: {', '.join(sorted(FAMILIES))}")
    if model_type not in FAMILIES:
        raise ModelConfigError(
            "model_type",
            f"{quote(model_type)} is not a family kvbank can count; known: "
            f"{', '.join(sorted(FAMILIES))}. Describe it by hand in model.architecture instead",
        )
    f = top
    if model_type in NESTED:
        nested = top.section("text_config")
        if nested is None:
            raise ModelConfigError("text_config", f"is missing; a {model_type} config nests it")
        f = nested
    att, groups = FAMILIES[model_type](f)
    dtype = (
        f.string("torch_dtype") or f.string("dtype") or top.string("torch_dtype")
        or top.string("dtype") or "bfloat16"
    )  # fmt: skip
    if dtype not in WEIGHT_DTYPES:
        raise ModelConfigError(
            "torch_dtype", f"must be one of {', '.join(WEIGHT_DTYPES)}, got {quote(dtype)}"
        )
    parameters, experts = parameter_estimate(f, att, groups)
    dense_bits, expert_bits = weight_bits(top, dtype)
    positions = (
        f.integer("max_position_embeddings", 1, 1 << 24) if f.has("max_position_embeddings")
        else None
    )  # fmt: skip
    return ModelLayout(
        model_type, groups, att.heads, dtype, parameters, experts, dense_bits, expert_bits,
        positions,
    )  # fmt: skip


def read_layout(path: str | Path) -> ModelLayout:
    return model_layout(load_config(path))
