"""The weights' size from a config's shapes: the estimate `kvbank plan` and a configured pool use
when the checkpoint's size is not given."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbank.capacity.configfile import MAX_DIM, MAX_LAYERS, ConfigFields
from kvbank.capacity.modellayout import WEIGHT_DTYPES, Kind, LayerGroup

if TYPE_CHECKING:
    from kvbank.capacity.hfconfig import Attention


def weight_bits(top: ConfigFields, dtype: str) -> tuple[float, float]:
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
    f: ConfigFields, att: Attention, groups: tuple[LayerGroup, ...]
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
