"""spec.model of a ModelPool: the model a pool serves and its shape (`Architecture`, or where its
config.json is, `ConfigSource`), and the reader of that section, `read_model`, which
`parse_modelpool` calls.

A shape is written field by field, from a preset of a published model (`preset: llama-3.1-8b`;
fields written beside it win) or as `fromConfig`, the model's own config.json, which
kvbank/capacity/configured.py resolves and beside which no hand-written field is allowed. Like
the rest of the parser, the reader collects problems in its `FieldReader` and never raises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbank.fields import FieldReader, quote
from kvbank.pod_template import read_name

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "fp8": 1, "int8": 1}
MAX_MODEL_NAME_LENGTH = 253


@dataclass(frozen=True)
class Architecture:
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    parameters: float
    dtype: str

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# Published shapes of common models, so a spec can say `preset: llama-3.1-8b`.
PRESETS: dict[str, Architecture] = {
    "llama-3.1-8b": Architecture(32, 32, 8, 128, 8.03e9, "bfloat16"),
    "llama-3.1-70b": Architecture(80, 64, 8, 128, 70.6e9, "bfloat16"),
    "qwen2.5-7b": Architecture(28, 28, 4, 128, 7.62e9, "bfloat16"),
    "qwen3-8b": Architecture(36, 32, 8, 128, 8.19e9, "bfloat16"),
    "mistral-7b": Architecture(32, 32, 8, 128, 7.24e9, "bfloat16"),
}


KV_DTYPES = ("bfloat16", "float16", "fp8", "fp8_per_token_head")
MAX_CONFIG_PATH = 4096
MAX_WEIGHTS_GIB = 1 << 20
# A ConfigMap's keys, as the apiserver allows them: the name of a file it may be mounted as.
CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
MAX_CONFIG_MAP_KEY = 253


@dataclass(frozen=True)
class ConfigSource:
    """Where a model's config.json is: a path (for `kvbank check`, relative to the manifest) or
    a ConfigMap key (for the operator); the KV cache dtype and, if given, the weights' size."""

    path: str | None = None
    config_map: str | None = None
    key: str = "config.json"
    kv_dtype: str = "bfloat16"
    weights_gib: float | None = None


# What an architecture read from config.json holds until it is resolved: nothing to count by.
CONFIGURED_ARCHITECTURE = Architecture(1, 1, 1, 1, 0.0, "bfloat16")


class ModelSpec(NamedTuple):
    """spec.model as read: the model's name, its shape (None where it was wrong) and, for
    `fromConfig`, where its config.json is."""

    name: str
    architecture: Architecture | None
    source: ConfigSource | None


def read_model(r: FieldReader, spec: Mapping[str, Any]) -> ModelSpec:
    """spec.model: {name, architecture, source}. `source` (where the weights come from) is the
    operator's (kvbank.deployment); this reader only lets it through."""
    model = r.mapping(spec.get("model"), "spec.model") or {}
    r.unknown(model, "spec.model", {"name", "architecture", "source"})
    model_name = r.string(model, "name", "spec.model") or ""
    if len(model_name) > MAX_MODEL_NAME_LENGTH:
        r.fail(
            "spec.model.name",
            f"has {len(model_name)} characters; at most {MAX_MODEL_NAME_LENGTH} are allowed",
        )
    arch = _architecture(r, model) if model else None
    source = None
    if isinstance(model.get("architecture"), Mapping) and "fromConfig" in model["architecture"]:
        source = _config_source(r, model["architecture"], "spec.model.architecture")
    return ModelSpec(model_name, arch, source)


def _config_source(r: FieldReader, arch: Mapping[str, Any], path: str) -> ConfigSource | None:
    """spec.model.architecture.fromConfig: {path} or {configMap: {name, key}}, kvDtype,
    weightsGiB. The hand-written fields do not mix with it."""
    path = f"{path}.fromConfig"
    src = r.mapping(arch.get("fromConfig"), path)
    if src is None:
        return None
    r.unknown(src, path, {"path", "configMap", "kvDtype", "weightsGiB"})
    mixed = sorted(k for k in arch if k != "fromConfig")
    if mixed:
        r.fail(path, f"describes the model by itself; drop {', '.join(mixed)} beside it")
    file = r.string(src, "path", path, required=False)
    if file is not None and len(file) > MAX_CONFIG_PATH:
        r.fail(f"{path}.path", f"has {len(file)} characters; at most {MAX_CONFIG_PATH}")
        file = None
    cm = r.mapping(src.get("configMap"), f"{path}.configMap", required=False)
    name = key = None
    if cm is not None:
        r.unknown(cm, f"{path}.configMap", {"name", "key"})
        name = read_name(r, cm, "name", f"{path}.configMap")
        key = r.string(cm, "key", f"{path}.configMap", required=False, default="config.json")
        if key is not None and (len(key) > MAX_CONFIG_MAP_KEY or not CONFIG_MAP_KEY.fullmatch(key)):
            r.fail(
                f"{path}.configMap.key",
                f"must be a ConfigMap key (at most {MAX_CONFIG_MAP_KEY} letters, digits, '-', "
                f"'_' and '.'), got {quote(key)}",
            )
            key = None
    if (file is None) == (cm is None):
        r.fail(path, "give exactly one of path (a local config.json) or configMap {name, key}")
    kv_dtype = r.string(src, "kvDtype", path, required=False, choices=KV_DTYPES,
                        default="bfloat16")  # fmt: skip
    weights = (
        r.number(src, "weightsGiB", path, lo=0, hi=MAX_WEIGHTS_GIB) if "weightsGiB" in src else None
    )
    if kv_dtype is None:
        return None
    return ConfigSource(file, name, key or "config.json", kv_dtype, weights)


def _architecture(r: FieldReader, model: Mapping[str, Any]) -> Architecture | None:
    path = "spec.model.architecture"
    arch = model.get("architecture")
    if arch is None:
        r.fail(
            path,
            f"is missing; give layers, attentionHeads, kvHeads, headDim, parameters and "
            f"dtype, or a preset ({', '.join(sorted(PRESETS))})",
        )
        return None
    arch = r.mapping(arch, path)
    if arch is None:
        return None
    if "fromConfig" in arch:  # read by _config_source; nothing here to count by
        return CONFIGURED_ARCHITECTURE
    known = {"preset", "layers", "attentionHeads", "kvHeads", "headDim", "parameters", "dtype"}
    r.unknown(arch, path, known)
    base: Architecture | None = None
    if "preset" in arch:
        preset = r.string(arch, "preset", path, choices=tuple(sorted(PRESETS)))
        if preset is None:
            return None
        base = PRESETS[preset]

    def pick(key: str, attr: str, lo: int, hi: int) -> int | None:
        default = getattr(base, attr) if base else None
        return r.integer(arch, key, path, lo=lo, hi=hi, default=default)

    layers = pick("layers", "layers", 1, 1024)
    heads = pick("attentionHeads", "attention_heads", 1, 1024)
    kv_heads = pick("kvHeads", "kv_heads", 1, 1024)
    head_dim = pick("headDim", "head_dim", 1, 4096)
    parameters = r.number(
        arch, "parameters", path, lo=0, hi=1e13, default=base.parameters if base else None
    )
    dtype = r.string(
        arch,
        "dtype",
        path,
        choices=tuple(DTYPE_BYTES),
        default=base.dtype if base else None,
        required=base is None,
    )
    if None in (layers, heads, kv_heads, head_dim, parameters, dtype):
        return None
    assert layers and heads and kv_heads and head_dim and dtype and parameters is not None
    if kv_heads > heads:
        r.fail(f"{path}.kvHeads", f"must be at most attentionHeads ({heads}), got {kv_heads}")
    elif heads % kv_heads:
        r.fail(f"{path}.kvHeads", f"must divide attentionHeads ({heads}), got {kv_heads}")
    return Architecture(layers, heads, kv_heads, head_dim, parameters, dtype)
