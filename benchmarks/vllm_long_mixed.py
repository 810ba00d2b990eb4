"""Long mixed runs through vLLM's real scheduler (CPU, no model) under kvbank's scheduler class:
400 requests a seed, three shared system prompts and requests of no prefix, a quarter of them
best-effort, 5% aborted by their clients, arrivals over about 600 steps onto 96 pages, so the
pool fills and refills many times. Each run: the embedded ledger in arrival order, in the prefix
order (deferral bounds 2048 and 8), and over a real `kvbank sidecar --debug` the engine never
waits on, in arrival and prefix order; vLLM stepped synchronously and as its async scheduling
steps it. After every step the ledger is checked against vLLM's blocks (the sidecar also checks
its own books after every report). A run fails on any strict preemption, any request left
unfinished, any block or reserved page not returned.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-vllm-cpu/bin/python benchmarks/vllm_long_mixed.py \\
        [--seeds 0 2]

Prints, per run: steps, requests the order moved, best-effort preemptions, wall seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm_scheduler"))

from vllm_builders import PAGE, bench, drive  # noqa: E402

from kvbank.vllm.scheduler import make_backend  # noqa: E402
from kvbank.vllm.settings import Settings  # noqa: E402

PAGES = 96
REQUESTS = 400
PREFIXES = {"a": [11] * 200, "b": [12] * 120, "c": [13] * 320}  # 12, 7 and 20 pages of 16
POLICY = "peak+backfill"


def mix(seed: int) -> tuple[dict[int, list[tuple]], dict[int, list[str]], set[str]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    aborts: dict[int, list[str]] = {}
    flex: set[str] = set()
    for i in range(REQUESTS):
        prefix = rng.choice([None, "a", "b", "c", "a", "c"])
        prompt = PREFIXES.get(prefix or "", []) + [100 + i % 800] * rng.randint(1, 120)
        max_tokens = rng.choice([None, rng.randint(8, 200)])
        output = rng.randint(1, 220)
        tier = "flex" if rng.random() < 0.25 else None
        if tier:
            flex.add(f"r{i}")
        at = int(i * 1.5) + rng.randint(0, 5)
        arrivals.setdefault(at, []).append((f"r{i}", prompt, max_tokens, output, tier))
        if rng.random() < 0.05:
            aborts.setdefault(at + rng.randint(0, 60), []).append(f"r{i}")
    return arrivals, aborts, flex


def one(seed: int, settings: Settings, async_scheduling: bool, backend: Any = None) -> str:
    arrivals, aborts, flex = mix(seed)
    run = bench(PAGES, POLICY, backend=backend, async_scheduling=async_scheduling,
                settings=settings)  # fmt: skip
    started = time.monotonic()
    seen = drive(run, arrivals, aborts, max_steps=60000, pause_s=0.001 if backend else 0.0)
    admission = run.sched.kvbank
    strict = set(seen.preempted) - flex
    if strict or admission.preemptions:
        raise AssertionError(f"seed {seed}: strict requests preempted: {sorted(strict)}")
    if len(seen.finished) != REQUESTS:
        raise AssertionError(f"seed {seed}: {REQUESTS - len(seen.finished)} never finished")
    if run.sched.kv_cache_manager.block_pool.get_num_free_blocks() != PAGES - 1:
        raise AssertionError(f"seed {seed}: blocks not returned")
    if admission.backend.outstanding():
        raise AssertionError(f"seed {seed}: {admission.backend.outstanding()} pages still held")
    return (f"steps {seen.steps}, moved {admission.order.moved}, best-effort preemptions "
            f"{sum(seen.preempted.values())}, {time.monotonic() - started:.0f} s")  # fmt: skip


def sidecar(token_file: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", "127.0.0.1:0",
         "--metrics-port", "-1", "--policy", POLICY, "--token-file", str(token_file), "--debug"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    match = re.search(r"serving on [\d.]+:(\d+)", proc.stdout.readline())
    if match is None:
        proc.kill()
        raise SystemExit("the sidecar did not start")
    return proc, f"127.0.0.1:{match.group(1)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 2), metavar=("FIRST", "END"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        token = Path(folder) / "token"
        token.write_text("long-mixed\n")
        proc, address = sidecar(token)
        sessions = 0
        try:
            for seed in range(*args.seeds):
                for mode in (False, True):
                    name = "async" if mode else "sync"
                    for order, bound in (("fifo", 0), ("prefix", 2048), ("prefix", 8)):
                        s = Settings(POLICY, order=order, max_defer_steps=bound)
                        print(f"{seed} embedded {order} {bound} {name}: {one(seed, s, mode)}",
                              flush=True)  # fmt: skip
                    for order in ("fifo", "prefix"):
                        sessions += 1
                        s = Settings(POLICY, address, token="long-mixed", blocking=False,
                                     order=order)  # fmt: skip
                        backend = make_backend(s, PAGES, PAGE, 0, engine_id=f"long-{sessions}")
                        print(f"{seed} sidecar {order} {name}: {one(seed, s, mode, backend)}",
                              flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
