"""Pages held over time for banker, peak and preempt on one scenario (default
chat-no-max-tokens), from one virtual-clock run each, plotted with `kvbank bench`'s own plot.

    .venv/bin/python benchmarks/peak_pages_plot.py [--scenario FILE] [--out docs/peak-pages.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvbank.engine.bench.cli import plot
from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(SCENARIOS / "chat-no-max-tokens.yaml"))
    parser.add_argument("--policies", default="banker,peak,preempt")
    parser.add_argument("--out", default="docs/peak-pages.png")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    results = [run_policy(scenario, name) for name in args.policies.split(",")]
    for r in results:
        m = r.metrics
        print(f"{r.policy}: {m['completed']} done, {m['requests_per_s']} req/s")
    plot(scenario, results, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
