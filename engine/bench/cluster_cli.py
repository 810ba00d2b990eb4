"""`kvbank bench --replicas N --router R`: the cluster bench's command line and its tables.

    kvbank bench --scenario scenarios/cluster-bursty-4.yaml --router all

Every router named runs over the same traffic in the same run, so the last lines compare
`kvbank` with `least-kv` as ratios measured there. Exit 2 on a bad flag (the message says what
to change), 1 when a replica breached an invariant, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvbank.engine.bench.cluster import ClusterResult, run_cluster
from kvbank.engine.bench.routers import ROUTERS, SCRAPE_S
from kvbank.engine.bench.scenario import Scenario
from kvbank.mode import LEDGER_MODE_NAMES
from kvbank.picker.lobby import DEFAULT_MAX_HOLD_S
from kvbank.service_class import ClassPolicy

# The replicas' admission when --policy names none: kvbank's ledger, peak-fit with backfill.
CLUSTER_POLICY = "peak+backfill"

POOL_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("router", "router", "{}"),
    ("done", "completed", "{}"),
    ("hung", "hung", "{}"),
    ("shed", "shed", "{}"),
    ("rej", "rejected", "{}"),
    ("req/s", "requests_per_s", "{:.3f}"),
    ("goodput/s", "goodput_per_s", "{:.3f}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}s"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}s"),
    ("strict TTFT p99", "strict_ttft_p99_s", "{:.2f}s"),
    ("held", "held_by_router", "{}"),
    ("hold p99", "hold_p99_s", "{:.2f}s"),
    ("waited", "routed_then_waited", "{}"),
    ("wait p99", "wait_p99_s", "{:.2f}s"),
    ("KV util", "kv_utilisation", "{:.0%}"),
    ("hit rate", "prefix_hit_rate", "{:.1%}"),
    ("preempt", "preemptions", "{}"),
    ("strict preempt", "strict_preemptions", "{}"),
    ("breaches", "invariant_breaches", "{}"),
    ("virtual s", "duration_s", "{:.1f}"),
)
REPLICA_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("router", "router", "{}"),
    ("replica", "replica", "{}"),
    ("sent", "sent", "{}"),
    ("done", "completed", "{}"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}s"),
    ("waited", "routed_then_waited", "{}"),
    ("wait p99", "wait_p99_s", "{:.2f}s"),
    ("KV util", "kv_utilisation", "{:.0%}"),
    ("preempt", "preemptions", "{}"),
    ("strict preempt", "strict_preemptions", "{}"),
    ("breaches", "invariant_breaches", "{}"),
)
LEGEND = (
    ("shed", "best-effort requests the router answered 429 (every pod full)"),
    ("goodput/s", "completions per virtual second that met their class's SLO"),
    ("strict TTFT p99", "time to first token of strict requests, 99th percentile"),
    ("held", "strict requests the kvbank picker held until a replica admitted them"),
    ("hold p99", "how long those were held (their TTFT counts it), 99th percentile"),
    ("waited", "requests routed to a replica that did not admit them at its next step"),
    ("wait p99", "how long those waited to be admitted, 99th percentile"),
)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="run N engines, each with its own ledger and policy, behind a router (default: "
        "the scenario's `replicas`, or one engine)",
    )
    parser.add_argument(
        "--router",
        default="all",
        help=f"with several replicas: {', '.join(ROUTERS)}, a comma-separated list, or 'all'",
    )
    parser.add_argument(
        "--scrape-ms",
        type=float,
        default=SCRAPE_S * 1000,
        metavar="MS",
        help="least-kv: how old its metrics may be, in virtual ms (the router scrapes every "
        "50 ms by default)",
    )
    parser.add_argument(
        "--max-hold-s",
        type=float,
        default=DEFAULT_MAX_HOLD_S,
        metavar="S",
        help="kvbank: how long the picker holds a strict request no replica admits now before "
        f"it queues where it starts soonest (`kvbank picker --max-hold-s`, default "
        f"{DEFAULT_MAX_HOLD_S:g}; 0 holds nothing)",
    )


def wants_cluster(args: argparse.Namespace, scenario: Scenario) -> bool:
    """--replicas given, or a scenario of several replicas."""
    return getattr(args, "replicas", None) is not None or scenario.replicas > 1


def run_cluster_cli(args: argparse.Namespace, scenario: Scenario) -> int:
    replicas = args.replicas if args.replicas is not None else scenario.replicas
    if replicas < 1:
        return _usage(f"--replicas must be at least 1, got {replicas}")
    routers = list(ROUTERS) if args.router == "all" else [r.strip() for r in args.router.split(",")]
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or not routers:
        return _usage(
            f"unknown --router {', '.join(map(repr, unknown))}; choose 'all' or one or more of "
            f"{', '.join(ROUTERS)}"
        )
    policy = CLUSTER_POLICY if args.policy == "all" else args.policy.strip()
    if policy not in LEDGER_MODE_NAMES:
        return _usage(
            f"the cluster bench runs one of kvbank's ledger policies on every replica "
            f"({', '.join(LEDGER_MODE_NAMES)}); got --policy {policy!r}"
        )
    if args.scrape_ms < 0:
        return _usage(f"--scrape-ms must be at least 0, got {args.scrape_ms:g}")
    if not args.max_hold_s >= 0:  # NaN too
        return _usage(f"--max-hold-s must be at least 0 (0 holds nothing), got {args.max_hold_s:g}")
    if getattr(args, "sidecar", None) or getattr(args, "plot", None):
        return _usage("--sidecar and --plot apply to one engine; drop them with --replicas")
    classes = ClassPolicy()
    results = [
        run_cluster(
            scenario,
            router,
            replicas,
            policy,
            args.scrape_ms / 1000.0,
            classes,
            check=getattr(args, "check", False),
            debug=args.debug,
            max_hold_s=args.max_hold_s,
        )
        for router in routers
    ]
    if args.json:
        print(json.dumps([{**r.metrics, "per_replica": r.replicas} for r in results], indent=2))
    else:
        print(render_cluster(scenario, results))
    return 1 if any(r.metrics["invariant_breaches"] for r in results) else 0


def _usage(message: str) -> int:
    print(f"kvbank bench: {message}", file=sys.stderr)
    return 2


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _table(columns: tuple[tuple[str, str, str], ...], rows: list[dict[str, Any]]) -> list[str]:
    header = [name for name, _, _ in columns]
    cells = [[_cell(row.get(key), fmt) for _, key, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    return [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *(
            "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
            for row in cells
        ),
    ]


def comparison(results: list[ClusterResult]) -> dict[str, float | None] | None:
    """kvbank against least-kv in this run: strict TTFT p99 and goodput as ratios."""
    by_router = {r.router: r.metrics for r in results}
    ours, theirs = by_router.get("kvbank"), by_router.get("least-kv")
    if ours is None or theirs is None:
        return None

    def ratio(key: str) -> float | None:
        a, b = ours.get(key), theirs.get(key)
        return None if a is None or not b else round(a / b, 3)

    return {
        "strict_ttft_p99_ratio": ratio("strict_ttft_p99_s"),
        "goodput_ratio": ratio("goodput_per_s"),
    }


def render_cluster(scenario: Scenario, results: list[ClusterResult]) -> str:
    first = results[0].metrics
    lines = [
        f"{scenario.name}: {first['replicas']} replicas x {scenario.pages} pages x "
        f"{scenario.model.page_size} tokens, policy {first['policy']} on each",
        "",
        *_table(POOL_COLUMNS, [r.metrics for r in results]),
    ]
    stops = [
        f"{r.router}: {r.metrics['stopped']}" for r in results if r.metrics["stopped"] != "finished"
    ]
    if stops:
        lines += ["", "stopped early: " + "; ".join(stops)]
    versus = comparison(results)
    if versus is not None:
        ttft, goodput = versus["strict_ttft_p99_ratio"], versus["goodput_ratio"]
        lines += [
            "",
            "kvbank / least-kv, same run: strict TTFT p99 "
            + _cell(ttft, "{:.2f}x")
            + ", goodput "
            + _cell(goodput, "{:.2f}x"),
        ]
    replica_rows = [{"router": r.router, **rep} for r in results for rep in r.replicas]
    lines += ["", "per replica:", "", *_table(REPLICA_COLUMNS, replica_rows)]
    width = max(len(name) for name, _ in LEGEND)
    lines += ["", *(f"{name.rjust(width)}  {meaning}" for name, meaning in LEGEND)]
    return "\n".join(lines)
