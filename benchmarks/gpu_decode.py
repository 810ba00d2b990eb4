"""Decode throughput of the engine's model path at Llama-3-8B shape: FlashInfer vs the torch path.

    python benchmarks/gpu_decode.py            # all 32 layers, batch 1/16/64, both backends
    python benchmarks/gpu_decode.py --layers 8 # fewer layers: figures are per the layers run

Random bf16 weights (the kernels do not care what the numbers are), every sequence at
`--context` tokens of KV already in its pages, one decode token per sequence per step through
`TorchRunner.run` (the same call the engine makes: paged batch build, attention plan, forward,
greedy sampling). Reports tokens/s and the fraction of the H200's 4.8 TB/s that the step's
compulsory reads (every weight once, plus every sequence's KV) would need at that speed.
Installs nothing; exits 0 with a message when there is no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H200_BYTES_PER_S = 4.8e12
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--backends", default="flashinfer,torch")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        print("gpu_decode: torch is not installed; nothing to measure")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: no CUDA GPU on this machine; nothing to measure (exit 0)")
        return 0
    if args.device != "cuda":
        args.backends = "torch"
        print("gpu_decode: smoke run off the GPU; the roofline column is meaningless here")

    from kvbank.engine.model.config import parse_config
    from kvbank.engine.model.llama import CausalLM

    backends = [b for b in args.backends.split(",") if b]
    if "flashinfer" in backends:
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            print("gpu_decode: flashinfer is not installed; measuring the torch path only")
            backends.remove("flashinfer")

    config = parse_config({**LLAMA3_8B, "num_hidden_layers": args.layers})
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if "embed_tokens" not in name)  # fmt: skip
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2

    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"{gpu}: Llama-3-8B shape, {args.layers} of 32 layers, bf16, context {args.context}, "
          f"page size {args.page_size}, {args.steps} timed steps")  # fmt: skip
    print(f"{'backend':<11} {'batch':>5} {'step ms':>9} {'tokens/s':>10} {'GB/s':>8} "
          f"{'of 4.8 TB/s':>11}")  # fmt: skip
    for backend in backends:
        for batch in [int(b) for b in args.batches.split(",")]:
            step_s = measure(model, backend, batch, args)
            tokens_per_s = batch / step_s
            moved = weight_bytes + batch * (args.context + args.steps // 2) * kv_bytes_per_token
            rate = moved / step_s
            print(f"{backend:<11} {batch:>5} {step_s * 1e3:>9.2f} {tokens_per_s:>10.1f} "
                  f"{rate / 1e9:>8.0f} {rate / H200_BYTES_PER_S:>10.1%}")  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.layers != 32:
        print(f"note: {args.layers} layers run; a 32-layer step reads about "
              f"{32 / args.layers:.1f}x the per-layer bytes (tokens/s would scale down by about "
              f"that, plus the LM head's fixed share)")  # fmt: skip
    return 0


def measure(model: object, backend: str, batch: int, args: argparse.Namespace) -> float:
    """Median seconds per decode step."""
    import torch

    from kvbank.engine.model.runner import TorchRunner
    from kvbank.engine.runner import RowInput, StepBatch

    size = args.page_size
    per_seq = -(-(args.context + args.warmup + args.steps + 1) // size)
    pages = 1 + batch * per_seq
    runner = TorchRunner(model, pages, size, eos_token_id=-1, attention=backend)  # type: ignore[arg-type]
    for cache in runner.caches:
        cache.normal_()  # the context is already "in" the pages
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    times = []
    for step in range(args.warmup + args.steps):
        position = args.context + step
        rows = [RowInput(f"s{i}", [1000 + i], position, tables[i], True) for i in range(batch)]
        _sync(torch)
        started = time.perf_counter()
        runner.run(StepBatch(step, rows))
        _sync(torch)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    del runner
    return statistics.median(times)


def _sync(torch: object) -> None:
    cuda = torch.cuda  # type: ignore[attr-defined]
    if cuda.is_available():
        cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
