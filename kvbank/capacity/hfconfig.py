"""A model's KV layout read from its Hugging Face `config.json`: which layers keep what, so the
capacity function counts the model people deploy rather than a hand-written shape.

A config file is hostile input (a user's path, a ConfigMap anyone in the namespace may edit): it
is read with a size and depth bound, every field it uses is typed and ranged, and a problem is
one `ModelConfigError` naming the field, never a traceback. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvbank.fields import check_size, quote

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; 1 MiB leaves room and bounds the read
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_DIM = 65536
MAX_WINDOW = 1 << 24
WEIGHT_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


class ModelConfigError(ValueError):
    """A config.json kvbank cannot read; `field` is the config key it is about."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class Kind(Enum):
    """What one layer keeps per request, each with its own worst-case rule (kvbank.capacity.
    layout): every position (full, MLA), the last window of positions (sliding), the current
    chunk (chunked local), or a fixed state whatever the length (Mamba, linear attention)."""

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MLA = "mla"
    MAMBA = "mamba"  # Mamba-1: conv and SSM state per channel
    MAMBA2 = "mamba2"  # Mamba-2: grouped B/C in the conv state, SSM state per head
    LINEAR = "linear"  # gated delta net linear attention (Qwen3-Next)

    @property
    def is_state(self) -> bool:
        return self in (Kind.MAMBA, Kind.MAMBA2, Kind.LINEAR)


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind and shape. Attention: `kv_heads` as the model has them (before tensor
    parallelism), K and V head dims, the window or chunk. MLA: one latent head of
    kv_lora_rank + qk_rope_head_dim, replicated on every rank. State layers: the sizes their
    state tensors are made of (`state`, read by `state_elements`)."""

    kind: Kind
    layers: int
    kv_heads: int = 0
    head_dim_k: int = 0
    head_dim_v: int = 0
    window: int = 0  # sliding window, or attention chunk
    state: tuple[tuple[str, int], ...] = ()

    def state_elements(self, tp: int, speculative_tokens: int = 0) -> tuple[int, ...]:
        """Elements of each state tensor of one layer on one rank (vLLM's state shapes). A
        Mamba-2 or gated delta net conv state keeps one more row per speculative token."""
        s = dict(self.state)
        if self.kind is Kind.MAMBA:
            inner = s["intermediate"] // tp
            return (inner * (s["d_conv"] - 1), inner * s["d_state"])
        if self.kind is Kind.MAMBA2:
            groups = _groups_per_rank(s["n_groups"], tp)
            conv_dim = s["intermediate"] // tp + 2 * groups * s["d_state"]
            return (
                conv_dim * (s["d_conv"] - 1 + speculative_tokens),
                s["n_heads"] // tp * s["head_dim"] * s["d_state"],
            )
        if self.kind is Kind.LINEAR:
            key_dim = s["key_heads"] * s["key_dim"]
            value_dim = s["value_heads"] * s["value_dim"]
            conv_dim = (2 * key_dim + value_dim) // tp
            return (
                conv_dim * (s["conv_kernel"] - 1 + speculative_tokens),
                s["value_heads"] // tp * s["key_dim"] * s["value_dim"],
            )
        return ()

    def state_divisors(self) -> dict[str, int]:
        """Sizes tensor parallelism must divide for this state to split evenly."""
        s = dict(self.state)
        if self.kind is Kind.MAMBA:
            return {"intermediate": s["intermediate"]}
        if self.kind is Kind.MAMBA2:
            return {"intermediate": s["intermediate"], "mamba_n_heads": s["n_heads"]}
        if self.kind is Kind.LINEAR:
            return {
                "linear_num_key_heads": s["key_heads"],
                "linear_num_value_heads": s["value_heads"],
            }
        return {}


def _groups_per_rank(n_groups: int, tp: int) -> int:
    """Mamba-2's B/C groups on one rank: split when TP divides them, else replicated up to TP
    (vLLM's extra groups for head shards), which needs a single group."""
    if n_groups % tp == 0:
        return n_groups // tp
    return 1


@dataclass(frozen=True)
class ModelLayout:
    """What capacity needs of a model, read off its config: its layer groups in layer order of
    first appearance, its query heads (tensor parallelism must divide them), the dtype its
    weights and state are stored in, and an estimate of its parameters (`parameter_estimate`)."""

    model_type: str
    groups: tuple[LayerGroup, ...]
    attention_heads: int
    weights_dtype: str
    parameters: float
    expert_parameters: float  # of `parameters`, those in routed experts
    dense_bits: float  # per parameter outside routed experts, as stored (16 for bf16)
    expert_bits: float  # per routed-expert parameter (4.25 for MXFP4 experts)
    max_position_embeddings: int | None

    @property
    def attention_layers(self) -> int:
        return sum(g.layers for g in self.groups if not g.kind.is_state)

    @property
    def kv_heads(self) -> int:
        """The attention layers' KV heads (the one count TP must split); 1 for MLA."""
        heads = [g.kv_heads for g in self.groups if not g.kind.is_state]
        return max(heads) if heads else 1

    def weight_bytes(self) -> float:
        """The checkpoint's bytes, as `parameter_estimate` counts its parameters."""
        dense = self.parameters - self.expert_parameters
        return (dense * self.dense_bits + self.expert_parameters * self.expert_bits) / 8


# ---- reading --------------------------------------------------------------------------------


def load_config(path: str | Path) -> Mapping[str, Any]:
    """Read a config.json with its bounds: at most MAX_CONFIG_BYTES, a JSON object, no NaN or
    Infinity, no deeper than a manifest may be."""
    where = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ModelConfigError(
            "config.json", f"cannot read {quote(where)}: {exc.strerror}"
        ) from None
    return parse_config_text(data, where)


def parse_config_text(data: bytes | str, where: str = "config.json") -> Mapping[str, Any]:
    size = len(data)
    if size > MAX_CONFIG_BYTES:
        raise ModelConfigError(
            "config.json",
            f"{quote(where)} is over {MAX_CONFIG_BYTES} bytes; a model's config is a few KiB "
            f"(give the model's config.json, not its weights or tokenizer)",
        )

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        doc = json.loads(data, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelConfigError(
            "config.json", f"{quote(where)} is not valid JSON: {text[:120]}"
        ) from None
    too_big = check_size(doc, "config.json")
    if too_big is not None:
        raise ModelConfigError(too_big.path, too_big.message)
    if not isinstance(doc, dict):
        raise ModelConfigError("config.json", f"must be a JSON object, got {type(doc).__name__}")
    return doc


class _Fields:
    """Typed reads out of one config mapping; `prefix` names nested sections (text_config)."""

    def __init__(self, doc: Mapping[str, Any], prefix: str = ""):
        self.doc = doc
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.doc.get(key) is not None

    def integer(self, key: str, lo: int, hi: int, default: int | None = None) -> int:
        value = self.doc.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(self.name(key), f"is missing; it must be {lo} to {hi}")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(
                self.name(key), f"must be an integer from {lo} to {hi}, got {quote(value)}"
            )
        if not lo <= value <= hi:
            raise ModelConfigError(self.name(key), f"must be from {lo} to {hi}, got {value}")
        return value

    def number(self, key: str, lo: float, hi: float, default: float) -> float:
        value = self.doc.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ModelConfigError(self.name(key), f"must be a number, got {quote(value)}")
        if not lo <= value <= hi:
            raise ModelConfigError(self.name(key), f"must be from {lo:g} to {hi:g}, got {value}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.doc.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(self.name(key), f"must be true or false, got {quote(value)}")
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.doc.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ModelConfigError(self.name(key), f"must be a string, got {quote(value)}")
        return value

    def strings(self, key: str, length: int, choices: tuple[str, ...]) -> list[str] | None:
        value = self.doc.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != length:
            got = f"{len(value)} entries" if isinstance(value, list) else quote(value)
            raise ModelConfigError(self.name(key), f"must list {length} layers, got {got}")
        for index, item in enumerate(value):
            if item not in choices:
                raise ModelConfigError(
                    f"{self.name(key)}[{index}]",
                    f"must be one of {', '.join(choices)}, got {quote(item)}",
                )
        return list(value)

    def ints(self, key: str, length: int, choices: tuple[int, ...]) -> list[int] | None:
        value = self.doc.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != length:
            got = f"{len(value)} entries" if isinstance(value, list) else quote(value)
            raise ModelConfigError(self.name(key), f"must list {length} layers, got {got}")
        for index, item in enumerate(value):
            if isinstance(item, bool) or item not in choices:
                raise ModelConfigError(
                    f"{self.name(key)}[{index}]",
                    f"must be one of {', '.join(map(str, choices))}, got {quote(item)}",
                )
        return list(value)

    def section(self, key: str) -> _Fields | None:
        value = self.doc.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ModelConfigError(self.name(key), f"must be an object, got {quote(value)}")
        return _Fields(value, f"{self.name(key)}.")


@dataclass(frozen=True)
class _Attention:
    """The attention shape most families share."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


def _attention(f: _Fields) -> _Attention:
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
    return _Attention(layers, heads, kv_heads, head_dim, hidden)


def _group_runs(
    kinds: list[Kind], make: Callable[[Kind, int], LayerGroup]
) -> tuple[LayerGroup, ...]:
    """One group per kind, in order of first appearance, counting its layers."""
    counts: dict[Kind, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return tuple(make(kind, count) for kind, count in counts.items())


def _attention_groups(att: _Attention, kinds: list[Kind], window: int) -> tuple[LayerGroup, ...]:
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


def _window(f: _Fields, key: str = "sliding_window") -> int:
    return f.integer(key, 1, MAX_WINDOW)


def _layer_types(f: _Fields, layers: int, names: dict[str, Kind]) -> list[Kind] | None:
    listed = f.strings("layer_types", layers, tuple(names))
    return None if listed is None else [names[name] for name in listed]


ATTENTION_NAMES = {"full_attention": Kind.FULL, "sliding_attention": Kind.SLIDING}


def _dense_llama(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
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


def _gpt_oss(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
    """Alternating sliding and full attention, as `layer_types` lists them (sliding first)."""
    att = _attention(f)
    kinds = _layer_types(f, att.layers, ATTENTION_NAMES)
    if kinds is None:
        kinds = [Kind.SLIDING if i % 2 == 0 else Kind.FULL for i in range(att.layers)]
    window = _window(f) if Kind.SLIDING in kinds else 0
    return att, _attention_groups(att, kinds, window)


def _gemma3(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
    """Sliding layers with one full layer every `sliding_window_pattern` (or `layer_types`)."""
    att = _attention(f)
    kinds = _layer_types(f, att.layers, ATTENTION_NAMES)
    if kinds is None:
        pattern = f.integer("sliding_window_pattern", 1, MAX_LAYERS, default=6)
        kinds = [Kind.FULL if (i + 1) % pattern == 0 else Kind.SLIDING for i in range(att.layers)]
    window = _window(f) if Kind.SLIDING in kinds else 0
    return att, _attention_groups(att, kinds, window)


def _llama4(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
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
    rope = f.ints("no_rope_layers", att.layers, (0, 1))
    if rope is None:
        interval = f.integer("no_rope_layer_interval", 1, MAX_LAYERS, default=4)
        rope = [int((i + 1) % interval != 0) for i in range(att.layers)]
    kinds = [Kind.CHUNKED if uses and chunk else Kind.FULL for uses in rope]
    return att, _attention_groups(att, kinds, chunk)


def _deepseek(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
    """Multi-head latent attention: each layer keeps one latent of kv_lora_rank plus the shared
    RoPE key of qk_rope_head_dim per token, the same on every rank."""
    att = _attention(f)
    rank = f.integer("kv_lora_rank", 1, MAX_DIM)
    rope = f.integer("qk_rope_head_dim", 1, MAX_DIM)
    return att, (LayerGroup(Kind.MLA, att.layers, 1, rank + rope, 0),)


def _qwen3_next(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
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


def _jamba(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
    """Mamba-1 layers with attention every `attn_layer_period` from `attn_layer_offset`
    (or as `layers_block_type` lists)."""
    att = _attention(f)
    names = {"attention": Kind.FULL, "mamba": Kind.MAMBA}
    listed = f.strings("layers_block_type", att.layers, tuple(names))
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


def _granite_hybrid(f: _Fields) -> tuple[_Attention, tuple[LayerGroup, ...]]:
    """Mamba-2 layers with attention where `layer_types` says `attention`."""
    att = _attention(f)
    names = {"attention": Kind.FULL, "mamba": Kind.MAMBA2}
    listed = f.strings("layer_types", att.layers, tuple(names))
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
    att: _Attention, kinds: list[Kind], state: tuple[tuple[str, int], ...]
) -> tuple[LayerGroup, ...]:
    def make(kind: Kind, count: int) -> LayerGroup:
        if kind.is_state:
            return LayerGroup(kind, count, state=state)
        return LayerGroup(kind, count, att.kv_heads, att.head_dim, att.head_dim)

    return _group_runs(kinds, make)


FAMILIES: dict[str, Callable[[_Fields], tuple[_Attention, tuple[LayerGroup, ...]]]] = {
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
    top = _Fields(doc)
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
    dense_bits, expert_bits = _weight_bits(top, dtype)
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


def _weight_bits(top: _Fields, dtype: str) -> tuple[float, float]:
    """Bits per parameter outside and inside routed experts: an MXFP4 checkpoint keeps its
    experts at 4 bits plus an 8-bit scale per 32 values; an FP8 one keeps every matrix at 8 bits
    (the estimate counts only matrices); anything else stores all at the weights' dtype."""
    quant = top.section("quantization_config")
    method = quant.string("quant_method") if quant else None
    full = 8.0 * WEIGHT_DTYPES[dtype]
    if method == "mxfp4":
        return full, 4.25
    if method == "fp8":
        return 8.0, 8.0
    return full, full


def parameter_estimate(
    f: _Fields, att: _Attention, groups: tuple[LayerGroup, ...]
) -> tuple[float, float]:
    """Parameters, and of them those in routed experts, from the config's sizes:
    embeddings (twice unless tied), per attention layer the Q, K, V and O projections (MLA:
    its low-rank projections), per layer a gated MLP of three matrices (dense, or every routed
    and shared expert of a MoE layer), and per state layer its input and output projections.
    Norms, biases, routers and convolution kernels are left out (under 0.1 %)."""
    hidden = att.hidden
    vocab = f.integer("vocab_size", 1, 1 << 24, default=32000)
    tied = f.flag("tie_word_embeddings", False)
    embed = vocab * hidden * (1 if tied else 2)
    inter = f.integer("intermediate_size", 1, 1 << 20, default=4 * hidden)
    experts = 0
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        if f.has(key):
            experts = f.integer(key, 0, 4096)
            break
    expert_inter = f.integer("moe_intermediate_size", 1, 1 << 20, default=inter)
    shared = f.integer("n_shared_experts", 0, 64, default=0)
    if f.has("interleave_moe_layer_step"):  # Llama 4: one shared expert of intermediate_size
        shared_inter = inter
    elif f.has("shared_expert_intermediate_size"):
        shared_inter = f.integer("shared_expert_intermediate_size", 0, 1 << 20)
    else:
        shared_inter = shared * expert_inter
    dense_layers = f.integer("first_k_dense_replace", 0, att.layers, default=0)
    attention = 0.0
    state = 0.0
    for group in groups:
        if group.kind is Kind.MLA:
            q_rank = f.integer("q_lora_rank", 1, MAX_DIM, default=hidden)
            nope = f.integer("qk_nope_head_dim", 1, MAX_DIM, default=128)
            rope = f.integer("qk_rope_head_dim", 1, MAX_DIM)
            v_dim = f.integer("v_head_dim", 1, MAX_DIM, default=128)
            lora = f.integer("kv_lora_rank", 1, MAX_DIM)
            per = (
                hidden * q_rank + q_rank * att.heads * (nope + rope) + hidden * (lora + rope)
                + lora * att.heads * (nope + v_dim) + att.heads * v_dim * hidden
            )  # fmt: skip
        elif group.kind.is_state:
            s = dict(group.state)
            if group.kind is Kind.LINEAR:
                width = s["key_heads"] * s["key_dim"] * 2 + s["value_heads"] * s["value_dim"] * 2
                per = hidden * width + s["value_heads"] * s["value_dim"] * hidden
            else:
                per = hidden * 2 * s["intermediate"] + s["intermediate"] * hidden
            state += per * group.layers
            continue
        else:
            per = hidden * att.heads * att.head_dim * 2 + hidden * 2 * group.kv_heads * (
                att.head_dim
            )
        attention += per * group.layers
    layers = att.layers
    if experts:
        period = f.integer("expert_layer_period", 1, MAX_LAYERS, default=1)  # Jamba: every 2nd
        moe_layers = (layers - dense_layers) // period
        dense_layers = layers - moe_layers
        routed = moe_layers * experts * 3 * hidden * expert_inter
        mlp = routed + moe_layers * 3 * hidden * shared_inter + dense_layers * 3 * hidden * inter
    else:
        routed = 0
        mlp = layers * 3 * hidden * inter
    return float(embed + attention + state + mlp), float(routed)
