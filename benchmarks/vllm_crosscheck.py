"""Stock vLLM, vLLM with kvbank's scheduler class, and kvbank's own engine, scenario by scenario,
all in one run (vLLM's environment: `make vllm-venv`):

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_crosscheck.py scenarios

For every scenario vLLM can express (one KV label, no fixed tokens; the others are listed with
the reason), it runs kvbank's `preempt` (this project's reading of vLLM) and `peak+backfill` on
kvbank's engine, and `vllm`, `vllm+banker`, `vllm+peak+backfill` through vLLM's real scheduler,
then prints a Markdown table and the ratios: `preempt` against `vllm` (requests/s and
preemptions: how faithful the baseline is) and `vllm+peak+backfill` against kvbank's engine
under `peak+backfill`. `--speculative-tokens 0` runs kvbank's engine without the scenarios'
speculative slot, which vLLM without a drafter does not allocate: the like-for-like reading.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvbank.engine.bench.scenario import ScenarioError, load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.engine.bench.vllm_cli import scenario_refusal
from kvbank.engine.bench.vllm_simulate import run_vllm_policy

KVBANK = ("preempt", "peak+backfill")
VLLM = ("vllm", "vllm+banker", "vllm+peak+backfill")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("=" if a == b else "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", type=Path, help="folder of scenario YAML files")
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        help="replace the scenarios' speculative_tokens on kvbank's engine (vLLM allocates none "
        "without a drafter)",
    )
    args = parser.parse_args()
    rows, checks = [], []
    for path in sorted(args.scenarios.glob("*.yaml")):
        try:
            scenario = load_scenario(path)
        except ScenarioError as exc:
            print(f"skipped {path.name}: {exc.problems[0]}", file=sys.stderr)
            continue
        why = scenario_refusal(scenario)
        if why is not None:
            print(f"skipped {path.name}: {why}", file=sys.stderr)
            continue
        own = scenario
        if args.speculative_tokens is not None:
            model = dataclasses.replace(scenario.model, speculative_tokens=args.speculative_tokens)
            own = dataclasses.replace(scenario, model=model)
        got = {p: run_policy(own, p).metrics for p in KVBANK}
        got.update({p: run_vllm_policy(scenario, p).metrics for p in VLLM})
        for policy, m in got.items():
            engine = "vllm" if policy.startswith("vllm") else "kvbank"
            rows.append(
                f"| {scenario.name} | {engine} | {policy} | {m['completed']} | {m['hung']} "
                f"| {m['requests_per_s']:.4f} | {m['preemptions']} | {m['prefix_hit_rate']:.3f} "
                f"| {m['max_running']} |"
            )
        pre, stock = got["preempt"], got["vllm"]
        ours, own = got["vllm+peak+backfill"], got["peak+backfill"]
        checks.append(
            f"| {scenario.name} | {_ratio(pre['requests_per_s'], stock['requests_per_s'])} "
            f"| {pre['preemptions']} / {stock['preemptions']} "
            f"| {_ratio(pre['preemptions'], stock['preemptions'])} "
            f"| {_ratio(ours['requests_per_s'], own['requests_per_s'])} "
            f"| {ours['preemptions']} | {ours['hung']} "
            f"| {_ratio(ours['requests_per_s'], stock['requests_per_s'])} |"
        )
    print("| scenario | engine | policy | done | hung | req/s | preemptions | hit rate | max run |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print(
        "| scenario | preempt / vllm req/s | preemptions preempt / vllm | ratio "
        "| vllm+peak+backfill / kvbank peak+backfill req/s | its preemptions | its hung "
        "| vllm+peak+backfill / vllm req/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
