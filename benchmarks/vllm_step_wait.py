"""How long vLLM's `schedule()` waits on kvbank's admission, embedded and over a sidecar process.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python benchmarks/vllm_step_wait.py
        [--scenario scenarios/shared-prefix.yaml] [--requests 48] [--step-ms 8]
        [--policy peak+backfill] [--runs 3]

vLLM's own scheduler (no model, as `kvbank bench --engine vllm` runs it) with kvbank's scheduler
class, three ways: the embedded ledger; a sidecar process each schedule waits on (what `kvbank
bench --engine vllm --sidecar` runs, so the run is the embedded one); and a sidecar no schedule
waits on (what a served vLLM runs). Each step sleeps `--step-ms` for the model's forward pass,
so a reply has the time it would have on a GPU to arrive. Prints, per mode and run, the median
and p99 of the wall time per step spent in kvbank's parts of the step (the admission pass
before vLLM schedules, what is reported after it schedules and after the step), the steps and
the requests completed, and the median over runs of each wait against the embedded ledger's
measured in the same round.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from sidecar_step_wait import percentile, sidecar, timed

from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.vllm_engine import VllmBench
from kvbank.engine.bench.workload import Arrivals
from kvbank.vllm.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def run(sc: Scenario, settings: Settings, step_s: float) -> dict[str, float]:
    bench = VllmBench(sc, settings)
    admission = bench.sched.kvbank
    spent: list[float] = [0.0]
    for name in ("admit", "scheduled", "step_done"):
        setattr(admission, name, timed(getattr(admission, name), spent))
    arrivals = Arrivals(sc.workload)
    in_flight: set[str] = set()
    done, clock = 0, 0.0  # the virtual clock: an open-loop workload's arrivals follow it

    def send(spec: Any) -> None:
        bench.add(spec.rid, spec.prompt, spec.cls.max_tokens, spec.output_tokens)
        in_flight.add(spec.rid)

    while True:
        arrivals.refill(clock, lambda: len(in_flight), send)
        if not bench.has_work():
            idle_until = arrivals.idle_until(clock)
            if idle_until is None:
                break
            clock = idle_until  # open loop, idle until the next arrival
            continue
        step = bench.step()
        clock += step.seconds
        for out in step.outputs:
            if out.finish_reason is not None:
                in_flight.discard(out.request_id)
                done += 1
        time.sleep(step_s)
        spent.append(0.0)
    flush = getattr(admission.backend, "flush", None)
    if flush is not None:
        flush()
    waits = [s * 1e6 for s in spent[:-1]]
    return {
        "p50_us": statistics.median(waits),
        "p99_us": percentile(waits, 99),
        "steps": len(waits),
        "completed": done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "shared-prefix.yaml"))
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--step-ms", type=float, default=8.0)
    parser.add_argument("--policy", default="peak+backfill")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sc = load_scenario(args.scenario)
    sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, requests=args.requests))
    step_s = args.step_ms / 1000
    modes = ("embedded", "sidecar, step waits", "sidecar, never waits")
    ratios: dict[str, list[float]] = {mode: [] for mode in modes}
    print(f"{sc.name}, {args.policy}, {args.requests} requests, {args.step_ms} ms model step")
    print(f"{'run':>3} {'mode':22} {'wait p50 us':>12} {'wait p99 us':>12} {'x embedded':>10} "
          f"{'steps':>6} {'done':>5}")  # fmt: skip
    for n in range(args.runs):
        rows = {"embedded": run(sc, Settings(args.policy), step_s)}
        for mode, blocking in (("sidecar, step waits", True), ("sidecar, never waits", False)):
            proc, address = sidecar(args.policy)
            try:
                rows[mode] = run(sc, Settings(args.policy, address, blocking=blocking), step_s)
            finally:
                proc.terminate()
                proc.wait(10)
        base = rows["embedded"]["p50_us"]
        for mode, r in rows.items():
            ratios[mode].append(r["p50_us"] / base)
            print(f"{n:3d} {mode:22} {r['p50_us']:12.0f} {r['p99_us']:12.0f} "
                  f"{r['p50_us'] / base:10.2f} {r['steps']:6.0f} {r['completed']:5.0f}",
                  flush=True)  # fmt: skip
    for mode in modes:
        print(f"median over {args.runs} runs, {mode}: {statistics.median(ratios[mode]):.2f}x")


if __name__ == "__main__":
    main()
