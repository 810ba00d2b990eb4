"""`kvbank plan`: from a model's config.json (or a preset) and the GPUs, the pool one rank gets
and what it promises -- pages and tokens per KV group, the worst-case requests it holds at once,
the longest maxSeqLen that still holds `--min-concurrency` of them, and the memory split. Every
figure comes from `count_pages` over the same layout `kvbank check` judges; `--write-pool`
writes a ModelPool that check accepts with the same figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbank.capacity import GIB, CapacityModel, largest_fitting, usable_pages, worst_case
from kvbank.capacity.configured import ConfiguredModel, configure
from kvbank.capacity.hfconfig import ModelConfigError, read_layout
from kvbank.capacity.layout import KV_DTYPE_BYTES, EngineSettings, LayoutError
from kvbank.capacity.modellayout import Kind, LayerGroup, ModelLayout
from kvbank.model_spec import PRESETS
from kvbank.modelpool import (
    API_GROUP,
    API_VERSION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KIND,
    MAX_SEQ_LEN,
)

UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
DEFAULT_SEQ_LEN = 131072  # when the config names no max_position_embeddings


def parse_size(text: str, bare_unit: int = 1) -> float:
    """'80GiB', '13.8GB', '1e10' (bytes; a bare number is `bare_unit`s)."""
    found = SIZE.match(text)
    if not found or found.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a size; write e.g. 80GiB, 13.8GB or a number of bytes"
        )
    unit = UNITS[found.group(2).lower()] if found.group(2) else bare_unit
    return float(found.group(1)) * unit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", metavar="FILE", help="the model's Hugging Face config.json")
    model.add_argument("--preset", choices=sorted(PRESETS), help="a preset architecture")
    parser.add_argument(
        "--gpu-memory",
        required=True,
        type=lambda t: parse_size(t, GIB),
        metavar="SIZE",
        help="memory of one GPU, e.g. 80GiB (a bare number: GiB)",
    )
    parser.add_argument(
        "--gpu-utilization",
        type=float,
        default=0.9,
        help="the share of GPU memory the engine may use",
    )
    parser.add_argument(
        "--reserve",
        type=lambda t: parse_size(t, GIB),
        default=0.0,
        metavar="SIZE",
        help="per rank, for activations and CUDA graphs (default: 0, as gpu.reservedGiB)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPE_BYTES),
        default="bfloat16",
        help="the KV cache's dtype (fp8: per-tensor scales; fp8_per_token_head budgets a float32 "
        "scale per token and head)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="prompt + output positions (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens one step schedules (a window holds two steps of them on top of itself)",
    )
    parser.add_argument(
        "--speculative-tokens", type=int, default=0, help="draft tokens per decode step"
    )
    parser.add_argument(
        "--min-concurrency",
        type=int,
        default=1,
        help="worst-case requests the pool must hold at once",
    )
    parser.add_argument(
        "--weights-bytes",
        type=parse_size,
        metavar="SIZE",
        help="the checkpoint's size (default: estimated from the config)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--write-pool", metavar="FILE", help="write a ModelPool for these figures")
    parser.add_argument("--name", default=None, help="the written pool's name")


@dataclass(frozen=True)
class Plan:
    configured: ConfiguredModel
    max_seq_len: int
    pages: int  # per rank, the sink page included
    budget_bytes: float
    reserve_bytes: float
    min_concurrency: int

    @property
    def model(self) -> CapacityModel:
        return self.configured.pool.capacity_model(self.max_seq_len, self.max_seq_len - 1)

    def figures(self) -> dict[str, Any]:
        layout = self.configured.pool
        model = self.model
        shape, worst = worst_case(model)
        usable = usable_pages(self.pages)
        ceiling = max(self.max_seq_len, self.configured.model.max_position_embeddings or 0)
        longest = largest_seq_len(
            self.configured, usable, self.min_concurrency, min(ceiling, MAX_SEQ_LEN)
        )
        kv_bytes = self.pages * layout.page_bytes
        weights = self.configured.weights_bytes_per_rank
        return {
            "model_type": layout.model_type,
            "tensor_parallel": layout.settings.tensor_parallel,
            "kv_dtype": layout.settings.kv_dtype,
            "page_size": layout.page_size,
            "page_bytes": layout.page_bytes,
            "layers_per_group": layout.layers_per_group,
            "kv_heads_per_rank": layout.kv_heads_per_rank,
            "pages": self.pages,
            "usable_pages": usable,
            # vLLM's "GPU KV cache size": the pool's pages split evenly over its groups
            "tokens_per_group": usable // len(layout.groups) * layout.page_size,
            "groups": [
                {
                    "label": g.label,
                    "kind": g.kind.value,
                    "layers": g.layers,
                    "rule": g.rule(),
                    "worst_request_pages": worst.per_label[g.label],
                }
                for g in layout.groups
            ],
            "max_seq_len": self.max_seq_len,
            "max_num_batched_tokens": layout.settings.max_num_batched_tokens,
            "worst_request_pages": worst.total,
            "worst_request_prompt_tokens": shape.prompt_tokens,
            "worst_concurrency": usable // worst.total if worst.total else 0,
            "min_concurrency": self.min_concurrency,
            "largest_max_seq_len": longest,
            "largest_max_tokens": None if longest is None else longest - 1,
            "memory": {
                "budget_bytes": int(self.budget_bytes),
                "weights_bytes": int(weights),
                "kv_bytes": kv_bytes,
                "reserve_bytes": int(self.reserve_bytes),
                "left_bytes": int(self.budget_bytes - weights - kv_bytes - self.reserve_bytes),
            },
        }


def largest_seq_len(
    configured: ConfiguredModel, usable: int, concurrency: int, ceiling: int
) -> int | None:
    """The largest maxSeqLen (maxTokens one less) at which `concurrency` worst-case requests
    fit in `usable` pages; None when not even 2 positions do."""
    layout = configured.pool

    def fits(n: int) -> bool:
        model = layout.capacity_model(n, n - 1)
        return concurrency * worst_case(model)[1].total <= usable

    return largest_fitting(2, max(2, ceiling), fits)


def preset_layout(name: str) -> ModelLayout:
    arch = PRESETS[name]
    group = LayerGroup(Kind.FULL, arch.layers, arch.kv_heads, arch.head_dim, arch.head_dim)
    bits = 8.0 * arch.dtype_bytes
    return ModelLayout(
        name, (group,), arch.attention_heads, arch.dtype, arch.parameters, 0.0, bits, bits, None
    )


def make_plan(args: argparse.Namespace) -> Plan:
    layout = read_layout(args.config) if args.config else preset_layout(args.preset)
    settings = EngineSettings(
        page_size=args.page_size,
        tensor_parallel=args.tp,
        kv_dtype=args.kv_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_tokens=args.speculative_tokens,
    )
    configured = configure(layout, settings, args.weights_bytes)
    seq_len = args.max_seq_len or layout.max_position_embeddings or DEFAULT_SEQ_LEN
    seq_len = min(seq_len, MAX_SEQ_LEN)
    budget = args.gpu_memory * args.gpu_utilization
    left = budget - configured.weights_bytes_per_rank - args.reserve
    pages = max(0, int(left // configured.pool.page_bytes))
    return Plan(configured, seq_len, pages, budget, args.reserve, args.min_concurrency)


def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, as one line naming the flag; None when nothing is."""
    ranges = {
        "--tp": (args.tp, 1, 64),
        "--page-size": (args.page_size, 1, 1024),
        "--max-num-batched-tokens": (args.max_num_batched_tokens, 1, MAX_SEQ_LEN),
        "--speculative-tokens": (args.speculative_tokens, 0, 64),
        "--min-concurrency": (args.min_concurrency, 1, 1 << 24),
        "--max-seq-len": (args.max_seq_len or 2, 2, MAX_SEQ_LEN),
    }
    for flag, (value, lo, hi) in ranges.items():
        if not lo <= value <= hi:
            return f"{flag} must be from {lo} to {hi}, got {value}"
    if not 0 < args.gpu_utilization <= 1:
        return f"--gpu-utilization must be above 0 and at most 1, got {args.gpu_utilization}"
    if args.preset and args.kv_dtype != PRESETS[args.preset].dtype:
        return (
            f"--kv-dtype {args.kv_dtype}: a preset keeps its KV in its weights' dtype "
            f"({PRESETS[args.preset].dtype}); give --config for another KV dtype"
        )
    if not 0 < args.gpu_memory <= 4096 * GIB:
        return f"--gpu-memory must be above 0 and at most 4096GiB, got {args.gpu_memory:g} bytes"
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_flags(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except ModelConfigError as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    except LayoutError as exc:
        flag = "--tp" if exc.field == "tensorParallel" else exc.field
        print(f"error: {flag}: {exc.message}", file=sys.stderr)
        return 2
    figures = plan.figures()
    if plan.pages < 2:
        print(
            f"error: weights {gib(figures['memory']['weights_bytes'])} GiB and reserve "
            f"{gib(plan.reserve_bytes)} GiB leave no KV pages in {gib(plan.budget_bytes)} GiB "
            f"per rank; raise --tp or --gpu-memory, or give --weights-bytes",
            file=sys.stderr,
        )
        return 1
    if args.write_pool:
        write_pool(Path(args.write_pool), args, plan, figures)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(describe(figures))
    return 0 if figures["worst_concurrency"] >= plan.min_concurrency else 1


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def describe(f: dict[str, Any]) -> str:
    mem = f["memory"]
    lines = [
        f"{f['model_type']} at TP {f['tensor_parallel']}, KV {f['kv_dtype']}: per rank "
        f"{f['pages']} pages of {f['page_size']} tokens ({f['page_bytes']} bytes: "
        f"{f['layers_per_group']} layers a group, {f['kv_heads_per_rank']} KV heads a rank); "
        f"{f['tokens_per_group']} tokens per group",
        f"memory per rank: budget {gib(mem['budget_bytes'])} GiB = weights "
        f"{gib(mem['weights_bytes'])} + KV {gib(mem['kv_bytes'])} + reserve "
        f"{gib(mem['reserve_bytes'])} + left {gib(mem['left_bytes'])} GiB",
    ]
    for g in f["groups"]:
        lines.append(
            f"  group {g['label']}: {g['layers']} layers, {g['rule']}; worst-case request "
            f"{g['worst_request_pages']} pages"
        )
    lines.append(
        f"maxSeqLen {f['max_seq_len']} (maxNumBatchedTokens {f['max_num_batched_tokens']}): "
        f"worst-case request {f['worst_request_pages']} pages; the pool holds "
        f"{f['worst_concurrency']} at once"
    )
    if f["largest_max_seq_len"] is None:
        lines.append(f"minConcurrency {f['min_concurrency']}: no maxSeqLen fits")
    else:
        lines.append(
            f"minConcurrency {f['min_concurrency']}: largest maxSeqLen "
            f"{f['largest_max_seq_len']} (maxTokens up to {f['largest_max_tokens']})"
        )
    return "\n".join(lines)


def write_pool(path: Path, args: argparse.Namespace, plan: Plan, f: dict[str, Any]) -> None:
    """A ModelPool that `kvbank check` accepts with these figures: the pages pinned, the
    maxSeqLen the plan was judged at (or the longest meeting minConcurrency, if shorter)."""
    import yaml

    seq_len = f["max_seq_len"]
    if f["worst_concurrency"] < plan.min_concurrency and f["largest_max_seq_len"]:
        seq_len = f["largest_max_seq_len"]
    if args.config:
        config = Path(args.config).resolve()
        try:
            where = str(config.relative_to(path.resolve().parent))
        except ValueError:
            where = str(config)
        architecture: dict[str, Any] = {"fromConfig": {"path": where, "kvDtype": args.kv_dtype}}
        if args.weights_bytes is not None:
            architecture["fromConfig"]["weightsGiB"] = args.weights_bytes / GIB
    else:
        architecture = {"preset": args.preset}
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", f["model_type"].lower()).strip("-")[:40]
    spec: dict[str, Any] = {
        "model": {"name": name, "architecture": architecture},
        "tensorParallel": args.tp,
        "gpu": {
            "memoryGiB": args.gpu_memory / GIB,
            "memoryUtilization": args.gpu_utilization,
            "reservedGiB": plan.reserve_bytes / GIB,
        },
        "kv": {
            "pageSize": f["page_size"],
            "pages": f["pages"],
            "speculativeTokens": args.speculative_tokens,
        },
        "limits": {
            "maxSeqLen": seq_len,
            "maxTokens": seq_len - 1,
            "maxNumBatchedTokens": args.max_num_batched_tokens,
        },
        "admission": {"minConcurrency": plan.min_concurrency},
    }
    if not args.config:
        spec["kvSlots"] = {"main": {"prompt": 1, "output": 1}}
    doc = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
