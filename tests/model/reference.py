"""Tiny Hugging Face reference checkpoints (random weights) saved the way real ones are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvbank.engine.runner import RowInput, SamplingParams, StepBatch

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def save_reference(kind: str, folder: Path, shard: bool = False, **overrides: Any) -> Any:
    """Build a transformers model with seeded random weights, save it, return it (float32)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    settings: dict[str, Any] = {**TINY, **overrides}
    if kind == "qwen3":
        settings.setdefault("head_dim", 16)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**settings)).to(torch.float32).eval()
    with torch.no_grad():  # spread the norms' weights so a mis-mapped one shows up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "5GB")
    return model


def prefill_row(rid: str, tokens: list[int], pages: list[int], start: int = 0) -> RowInput:
    return RowInput(rid, tokens, start, pages, True, SamplingParams())


def batch(*rows: RowInput, step: int = 0) -> StepBatch:
    return StepBatch(step, rows)
