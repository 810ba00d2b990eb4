"""Load a Hugging Face checkpoint (config.json + *.safetensors, sharded or not) into `CausalLM`.

The model is built on the meta device and given uninitialised storage, then every tensor is read
from its file straight into its parameter, one at a time, through safetensors' lazy slices: a
rank reads only its own shard, and peak memory is the model plus one tensor, never two copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvbank.engine.model.config import ModelConfig, load_config
from kvbank.engine.model.llama import CausalLM, Parallel

# Parameters split along dim 0 (column-parallel) or dim 1 (row-parallel) under TP.
_COLUMN = ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_ROW = ("o_proj.weight", "down_proj.weight")
# Tensors some checkpoints carry that this model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there and tests compare in float32), bf16 on GPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no *.safetensors files")
    return files


def load_model(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype | None = None,
    parallel: Parallel | None = None,
) -> CausalLM:
    config = load_config(model_dir)
    parallel = parallel or Parallel()
    with torch.device("meta"):
        model = CausalLM(config, parallel)
    model = model.to(dtype or default_dtype(device)).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in params:
                    if _ignorable(name, config):
                        continue
                    raise CheckpointError(
                        f"{path.name} holds {name!r}, which a {config.architecture} with this "
                        f"config.json does not have; check that config.json matches the weights"
                    )
                tensor = _read_shard(f.get_slice(name), name, config, parallel)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{name}: checkpoint shard has shape {tuple(tensor.shape)}, the model "
                        f"expects {tuple(param.shape)} (tp rank {parallel.rank} of "
                        f"{parallel.world}); check config.json"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"{model_dir} lacks {len(missing)} weight(s): {shown}")
    return model.eval()


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def _read_shard(
    tensor_slice: object, name: str, config: ModelConfig, parallel: Parallel
) -> torch.Tensor:
    view = tensor_slice  # safetensors' PySafeSlice: indexing reads only that part of the file
    rank, world = parallel.rank, parallel.world
    shape = view.get_shape()  # type: ignore[attr-defined]
    if world == 1:
        return view[:]  # type: ignore[index]
    if name.endswith(_COLUMN):
        size = shape[0] // world
        return view[rank * size : (rank + 1) * size]  # type: ignore[index]
    if name.endswith(_ROW):
        size = shape[1] // world
        return view[:, rank * size : (rank + 1) * size]  # type: ignore[index]
    if name.endswith(_KV):
        kv = config.num_kv_heads
        # TP beyond the KV head count replicates: ranks r*kv/world share head r // (world // kv).
        head = rank * kv // world if kv >= world else rank // (world // kv)
        per_rank = max(1, kv // world)
        size = per_rank * config.head_dim
        return view[head * config.head_dim : head * config.head_dim + size]  # type: ignore[index]
    return view[:]  # type: ignore[index]
