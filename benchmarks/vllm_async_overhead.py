"""The host time kvbank's scheduler class adds to each vLLM step, synchronous and async.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python benchmarks/vllm_async_overhead.py
        [--scenario scenarios/loose-pool.yaml] [--requests 128] [--policy peak+backfill]
        [--runs 3]

vLLM's own scheduler with no model (as `kvbank bench --engine vllm` runs it), stock and with
kvbank's class (embedded ledger), stepped with --no-async-scheduling and as vLLM's async
scheduling steps it (its engine core's batch queue of two). The figure is the wall time per
step of `schedule()` and `update_from_output()` together: the scheduler's host work, which a
GPU step must hide under async scheduling. On a loose pool both run the same steps, so the
ratio is the plug-in's cost alone. Prints each round's median and p99 per step, steps and
completed requests, and, per mode, the median over rounds of kvbank's median against stock's
measured in the same round. vLLM's CPU platform serves synchronously only, so this is where
the async path's cost can be measured on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from sidecar_step_wait import percentile, timed

from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.vllm_engine import VllmBench
from kvbank.engine.bench.workload import Arrivals
from kvbank.vllm.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": False, "async": True}


def run(sc: Scenario, settings: Settings | None, async_scheduling: bool) -> dict[str, float]:
    bench = VllmBench(sc, settings, async_scheduling=async_scheduling)
    sched = bench.sched
    spent: list[float] = [0.0]
    for name in ("schedule", "update_from_output"):
        setattr(sched, name, timed(getattr(sched, name), spent))
    arrivals = Arrivals(sc.workload)
    in_flight: set[str] = set()
    done = preempted = 0

    def send(spec: Any) -> None:
        bench.add(spec.rid, spec.prompt, spec.cls.max_tokens, spec.output_tokens)
        in_flight.add(spec.rid)

    while True:
        arrivals.refill(0.0, lambda: len(in_flight), send)
        if not bench.has_work():
            break
        step = bench.step()
        preempted += step.preempted
        for out in step.outputs:
            if out.finish_reason is not None:
                in_flight.discard(out.request_id)
                done += 1
        spent.append(0.0)
    per_step = [s * 1e6 for s in spent[:-1]]
    return {
        "p50_us": statistics.median(per_step),
        "p99_us": percentile(per_step, 99),
        "steps": len(per_step),
        "completed": done,
        "preempted": preempted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "loose-pool.yaml"))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--policy", default="peak+backfill")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sc = load_scenario(args.scenario)
    sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, requests=args.requests))
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    print(f"{sc.name}, {args.requests} requests, kvbank {args.policy} (embedded) against stock")
    print(f"{'run':>3} {'mode':6} {'scheduler':8} {'p50 us':>8} {'p99 us':>8} {'x stock':>8} "
          f"{'steps':>6} {'done':>5} {'preempted':>9}")  # fmt: skip
    for n in range(args.runs):
        for mode, async_scheduling in MODES.items():
            rows = {
                "stock": run(sc, None, async_scheduling),
                "kvbank": run(sc, Settings(args.policy), async_scheduling),
            }
            base = rows["stock"]["p50_us"]
            ratios[mode].append(rows["kvbank"]["p50_us"] / base)
            for name, r in rows.items():
                print(f"{n:3d} {mode:6} {name:8} {r['p50_us']:8.0f} {r['p99_us']:8.0f} "
                      f"{r['p50_us'] / base:8.2f} {r['steps']:6.0f} {r['completed']:5.0f} "
                      f"{r['preempted']:9.0f}", flush=True)  # fmt: skip
    for mode in MODES:
        ratio = statistics.median(ratios[mode])
        print(f"median over {args.runs} runs, {mode}: kvbank {ratio:.2f}x stock")


if __name__ == "__main__":
    main()
