"""What capacity needs of a model, whatever describes it (a config.json, a preset): its layer
groups, each of one kind and shape, its query heads, and its weights."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

WEIGHT_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
