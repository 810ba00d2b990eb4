"""`kvbank bench`: run a scenario under one or more admission policies, side by side.

    kvbank bench --scenario shared-prefix.yaml --policy all --plot shared-prefix.png

Exit 2 on a malformed scenario (the message names every bad field), 1 when a policy breached an
invariant, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvbank.engine.admission.registry import policy_names
from kvbank.engine.bench.classplot import plot_classes
from kvbank.engine.bench.classtable import has_classes, render_classes
from kvbank.engine.bench.cluster_cli import add_cluster_arguments, run_cluster_cli, wants_cluster
from kvbank.engine.bench.plot import check_target, plot
from kvbank.engine.bench.scenario import Scenario, ScenarioError, load_scenario
from kvbank.engine.bench.simulate import RunResult, run_policy
from kvbank.mode import LEDGER_MODE_NAMES
from kvbank.service_class import ClassPolicy, Estimate, Victim

__all__ = ["add_arguments", "plot", "render_table", "run"]

# Columns of the table: (header, metric key, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("done", "completed", "{}"),
    ("hung", "hung", "{}"),
    ("rej", "rejected", "{}"),
    ("req/s", "requests_per_s", "{:.3f}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}s"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}s"),
    ("KV util", "kv_utilisation", "{:.0%}"),
    ("preempt", "preemptions", "{}"),
    ("hit rate", "prefix_hit_rate", "{:.1%}"),
    ("breaches", "invariant_breaches", "{}"),
    ("max run", "max_running", "{}"),
    ("virtual s", "duration_s", "{:.1f}"),
)

# What each column means, printed under the table.
LEGEND = (
    ("done", "requests completed"),
    ("hung", "sent, but neither completed nor refused when the run stopped"),
    ("rej", "refused at arrival: the pool can never hold them"),
    ("req/s", "completions per virtual second"),
    ("TTFT p50/p99", "time to first token, median and 99th percentile ('-': none completed)"),
    ("KV util", "mean share of the usable pages held"),
    ("preempt", "requests preempted (recomputed later)"),
    ("hit rate", "prompt tokens served from the prefix cache"),
    ("breaches", "invariant breaches: must be 0"),
    ("max run", "most requests running at once"),
    ("virtual s", "virtual time the run took"),
)
TTFT_KEYS = ("ttft_p50_s", "ttft_p99_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, help="scenario YAML file")
    parser.add_argument(
        "--policy",
        default="all",
        help=f"admission policy, a comma-separated list, or 'all' ({', '.join(policy_names())})",
    )
    parser.add_argument(
        "--engine",
        choices=("kvbank", "vllm"),
        default="kvbank",
        help="kvbank's engine, or vLLM's own v1 scheduler and KV cache manager (policies vllm, "
        "vllm+banker, vllm+peak+backfill, vllm+peak+backfill+prefix: the prefix order; runs in "
        "vLLM's environment, see `make vllm-venv`)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON, one object per policy")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot pages held and requests running to this file (its folder must exist)",
    )
    parser.add_argument(
        "--plot-classes",
        metavar="FILE.png",
        help="plot pages held by each request class over time, one panel per policy",
    )
    parser.add_argument(
        "--debug", action="store_true", help="deep integrity checks after every step (slower)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="after every step, the second safety check: every running strict request can "
        "still get every page it may need, recomputed from the pool's raw state "
        "(kvbank's ledger policies; --debug runs it too)",
    )
    parser.add_argument(
        "--backfill",
        action="store_true",
        help="EASY backfill on top of the banker and peak policies named (banker -> "
        "banker+backfill, peak -> peak+backfill)",
    )
    parser.add_argument(
        "--victim",
        choices=[v.value for v in Victim],
        default=Victim.NEWEST.value,
        help="which best-effort request a shortage preempts (kvbank's policies)",
    )
    parser.add_argument(
        "--estimate",
        choices=[e.value for e in Estimate],
        default=Estimate.LEARNED.value,
        help="how a best-effort admission estimates its output (kvbank's policies)",
    )
    parser.add_argument(
        "--sidecar",
        metavar="ADDR",
        help="keep the ledger in the sidecar at ADDR instead of in-process (banker, peak, "
        "peak+backfill, banker+backfill; the sidecar must run the policy named)",
    )
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"kvbank bench: invalid scenario {exc.args[0]}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvbank bench: cannot read the scenario: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "engine", "kvbank") == "vllm":
        from kvbank.engine.bench.vllm_cli import run_vllm

        return run_vllm(args, scenario)
    if wants_cluster(args, scenario):
        return run_cluster_cli(args, scenario)
    names = policy_names()
    policies = names if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
    if getattr(args, "backfill", False):
        with_backfill = {"banker": "banker+backfill", "peak": "peak+backfill"}
        if not any(p in with_backfill for p in policies):
            print(
                "kvbank bench: --backfill applies to the banker and peak policies; name one of "
                "them in --policy",
                file=sys.stderr,
            )
            return 2
        policies = list(dict.fromkeys(with_backfill.get(p, p) for p in policies))
    unknown = [p for p in policies if p not in names]
    if unknown or not policies:
        print(
            f"kvbank bench: unknown --policy {', '.join(map(repr, unknown))}; choose 'all' or "
            f"one or more of {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    for target in (args.plot, args.plot_classes):
        if target and (problem := check_target(Path(target))) is not None:
            print(f"kvbank bench: {problem}", file=sys.stderr)
            return 2
    classes = ClassPolicy(
        victim=Victim(getattr(args, "victim", Victim.NEWEST)),
        estimate=Estimate(getattr(args, "estimate", Estimate.LEARNED)),
    )
    results = [
        run_policy(
            scenario,
            name,
            args.debug,
            True,
            _backend(args.sidecar, name, scenario),
            classes=classes,
            check=getattr(args, "check", False),
        )
        for name in policies
    ]
    if args.json:
        print(json.dumps([r.metrics for r in results], indent=2))
    else:
        print(render_table(scenario, results))
    if args.plot:
        plot(scenario, results, Path(args.plot))
        print(f"kvbank bench: plot written to {Path(args.plot).resolve()}", file=sys.stderr)
    if args.plot_classes:
        plot_classes(scenario, results, Path(args.plot_classes))
        print(f"kvbank bench: plot written to {Path(args.plot_classes).resolve()}", file=sys.stderr)
    return 1 if any(r.metrics["invariant_breaches"] for r in results) else 0


def _backend(sidecar: str | None, policy: str, scenario: Scenario) -> Any:
    """The sidecar backend when --sidecar is given, for every policy whose ledger the sidecar
    runs (the sidecar must run that one: see `kvbank sidecar --policy`); it waits for each
    answer, which is free on the virtual clock and makes the run identical to the embedded."""
    if sidecar is None or policy not in LEDGER_MODE_NAMES:
        return None
    from kvbank.sidecar.backend import connect

    return connect(sidecar, scenario.pages, blocking=True, engine_id=f"bench-{scenario.name}")


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_table(scenario: Scenario, results: list[RunResult]) -> str:
    """A plain-text (and Markdown) table, one row per policy, then TTFT p50 per class."""
    header = [name for name, _, _ in COLUMNS]
    rows = [
        [
            "-" if key in TTFT_KEYS and not r.metrics["completed"] else _cell(r.metrics[key], fmt)
            for _, key, fmt in COLUMNS
        ]
        for r in results
    ]
    classes = sorted({c for r in results for c in r.metrics["ttft_by_class"]})
    if len(classes) > 1:
        header += [f"TTFT p50 {c}" for c in classes]
        for row, r in zip(rows, results, strict=True):
            by_class = r.metrics["ttft_by_class"]
            done = r.metrics["completed"]
            row += [
                _cell(by_class.get(c, {}).get("p50_s") if done else None, "{:.2f}s")
                for c in classes
            ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"{scenario.name}: {scenario.pages} pages x {scenario.model.page_size} tokens"
        + (f", tp {scenario.tp} (rank 0 simulated)" if scenario.tp > 1 else ""),
        "",
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    stops = [
        f"{r.policy}: {r.metrics['stopped']}" for r in results if r.metrics["stopped"] != "finished"
    ]
    if stops:
        lines += ["", "stopped early: " + "; ".join(stops)]
    width = max(len(name) for name, _ in LEGEND)
    lines += ["", *(f"{name.rjust(width)}  {meaning}" for name, meaning in LEGEND)]
    if has_classes(scenario):
        lines += ["", *render_classes(results)]
    return "\n".join(lines)
