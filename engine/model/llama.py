"""The Llama-family decoder (Llama 2/3, Qwen2 with qkv bias, Qwen3 with q/k norm) on paged KV.

Parameter names match Hugging Face checkpoints, so the loader maps them one to one. Under tensor
parallelism the attention heads and the MLP's intermediate dimension are split across ranks
(q/k/v, gate/up column-parallel; o/down row-parallel, followed by an all-reduce); embeddings,
norms and the LM head are replicated, which costs vocab x hidden per rank but needs no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kvbank.engine.model.attention import AttentionBackend, PagedBatch, write_kv
from kvbank.engine.model.config import ModelConfig
from kvbank.engine.model.rope import Rotary, apply_rotary


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the tensor-parallel group (rank 0 of 1 when not parallel)."""

    rank: int = 0
    world: int = 1

    def kv_heads(self, config: ModelConfig) -> int:
        """KV heads this rank stores: split when TP divides them, replicated when TP exceeds."""
        return max(1, config.num_kv_heads // self.world)

    def check(self, config: ModelConfig) -> None:
        tp, heads, kv = self.world, config.num_heads, config.num_kv_heads
        problems = []
        if heads % tp:
            problems.append(f"num_attention_heads={heads} is not divisible by --tp {tp}")
        if kv % tp and tp % kv:
            problems.append(f"num_key_value_heads={kv} and --tp {tp}: one must divide the other")
        if config.intermediate_size % tp:
            problems.append(
                f"intermediate_size={config.intermediate_size} is not divisible by --tp {tp}"
            )
        if problems:
            raise ValueError("; ".join(problems) + "; choose a --tp that divides them")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _all_reduce(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    if parallel.world > 1:
        dist.all_reduce(x)
    return x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        self.heads = config.num_heads // parallel.world
        self.kv_heads = parallel.kv_heads(config)
        self.head_dim = d = config.head_dim
        self.parallel = parallel
        bias = config.qkv_bias
        self.q_proj = Linear(config.hidden_size, self.heads * d, bias)
        self.k_proj = Linear(config.hidden_size, self.kv_heads * d, bias)
        self.v_proj = Linear(config.hidden_size, self.kv_heads * d, bias)
        self.o_proj = Linear(self.heads * d, config.hidden_size)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        batch: PagedBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(cache, k, v, batch)
        out = backend.attend(q, cache, batch).reshape(tokens, self.heads * self.head_dim)
        return _all_reduce(self.o_proj(out), self.parallel)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        inner = config.intermediate_size // parallel.world
        self.gate_proj = Linear(config.hidden_size, inner)
        self.up_proj = Linear(config.hidden_size, inner)
        self.down_proj = Linear(inner, config.hidden_size)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return _all_reduce(self.down_proj(inner), self.parallel)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, parallel)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        batch: PagedBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, parallel) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Built on the meta device (no memory), then `to_empty` + the loader fill every weight."""

    def __init__(self, config: ModelConfig, parallel: Parallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or Parallel()
        self.parallel.check(config)
        self.model = Decoder(config, self.parallel)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        )
        self.rotary: Rotary | None = None

    @property
    def embedding(self) -> torch.Tensor:
        weight: torch.Tensor = self.model.embed_tokens.weight
        return weight

    @property
    def kv_heads(self) -> int:
        return self.parallel.kv_heads(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        batch: PagedBatch,
        caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [tokens, hidden]."""
        if self.rotary is None:
            self.rotary = Rotary(self.config, input_ids.device)
        h = nn.functional.embedding(input_ids, self.embedding)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            h = layer(h, cos, sin, cache, batch, backend)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] -> float32 logits [rows, vocab]."""
        weight = self.lm_head.weight if self.lm_head is not None else self.embedding
        return nn.functional.linear(hidden, weight).to(torch.float32)
