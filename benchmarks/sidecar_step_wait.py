"""How long the engine's step waits on admission, embedded and over a sidecar process.

    python benchmarks/sidecar_step_wait.py [--scenario scenarios/shared-prefix.yaml]
        [--requests 48] [--step-ms 8] [--policy peak+backfill]

Runs one closed-loop scenario through the real engine (virtual runner, real scheduler, pool
and ledger) three ways: the embedded ledger; a sidecar process the step waits on (the blocking,
in-step tries `kvbank bench --sidecar` uses); and a sidecar the step never waits on
(what `kvbank serve --sidecar` runs). Each step sleeps `--step-ms` to stand in for the model's
forward pass, so a reply has the time it would have on a GPU to arrive. Prints, per mode, the
median and p99 of the wall time per step spent in the admission policy's calls (admit and the
end-of-step report), the steps the run took and the requests completed, and the ratio of the
waits against the embedded ledger measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serving on [\d.]+:(\d+)")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[-1] += time.perf_counter() - start

    return wrapper


def timed_pass(fn: Callable[[], Iterator[Any]], spent: list[float]) -> Callable[[], Iterator[Any]]:
    """An admission pass timed while the policy runs (between the decisions it yields), not
    while the scheduler carries them out."""

    def wrapper() -> Iterator[Any]:
        actions = fn()
        while True:
            start = time.perf_counter()
            try:
                action = next(actions)
            except StopIteration:
                return
            finally:
                spent[-1] += time.perf_counter() - start
            yield action

    return wrapper


def run(sc: Scenario, policy: str, backend: Any, step_s: float) -> dict[str, float]:
    spent: list[float] = [0.0]

    def prepare(engine: Engine) -> None:
        engine.policy.admit = timed_pass(engine.policy.admit, spent)  # type: ignore[method-assign]
        engine.policy.end_step = timed(engine.policy.end_step, spent)  # type: ignore[method-assign]

    def after_step() -> None:
        time.sleep(step_s)
        spent.append(0.0)

    result = run_policy(sc, policy, backend=backend, prepare=prepare, after_step=after_step)
    waits = [s * 1e6 for s in spent[:-1]]
    return {
        "p50_us": statistics.median(waits),
        "p99_us": percentile(waits, 99),
        "steps": len(waits),
        "completed": result.metrics["completed"],
    }


def sidecar(policy: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", "127.0.0.1:0",
           "--metrics-port", "-1", "--policy", policy]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    match = READY.search(proc.stdout.readline())
    if not match:
        proc.kill()
        raise SystemExit("the sidecar did not start")
    return proc, f"127.0.0.1:{match.group(1)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "shared-prefix.yaml"))
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--step-ms", type=float, default=8.0)
    parser.add_argument("--policy", default="peak+backfill")
    args = parser.parse_args()
    from kvbank.ledger.client import embedded
    from kvbank.sidecar.backend import connect

    sc = load_scenario(args.scenario)
    sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, requests=args.requests))
    step_s = args.step_ms / 1000
    rows = {"embedded": run(sc, args.policy, embedded(sc.pages), step_s)}
    for mode, blocking in (("sidecar, step waits", True), ("sidecar, never waits", False)):
        proc, address = sidecar(args.policy)
        try:
            backend = connect(address, sc.pages, blocking=blocking, engine_id="bench")
            rows[mode] = run(sc, args.policy, backend, step_s)
        finally:
            proc.terminate()
            proc.wait(10)
    base = rows["embedded"]["p50_us"]
    print(f"{sc.name}, {args.policy}, {args.requests} requests, {args.step_ms} ms model step")
    print(f"{'mode':22} {'wait p50 us':>12} {'wait p99 us':>12} {'x embedded':>10} "
          f"{'steps':>6} {'done':>5}")  # fmt: skip
    for mode, r in rows.items():
        print(f"{mode:22} {r['p50_us']:12.0f} {r['p99_us']:12.0f} {r['p50_us'] / base:10.2f} "
              f"{r['steps']:6.0f} {r['completed']:5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
