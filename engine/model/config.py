"""The model shape read from a Hugging Face `config.json` (Llama 2/3, Qwen2, Qwen3 families)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json this runner cannot load; the message names the field and what is supported."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    torch_dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{path} does not exist; --model must name a Hugging Face folder"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"config.json architectures[0]={arch!r} is not supported; this runner loads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if key not in raw:
            raise ConfigError(f"config.json has no {key!r}; it is required for {arch}")
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_field(raw, "rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", is_qwen2)),
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        rope_scaling=_rope_scaling(raw),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )


def _rope_field(raw: dict[str, Any], key: str, default: Any) -> Any:
    # transformers 5 writes rope settings under "rope_parameters"; older configs at top level.
    params = raw.get("rope_parameters") or {}
    return raw.get(key, params.get(key, default))


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json rope_scaling.rope_type={rope_type!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
