"""Small scenarios and a step driver over vLLM's real scheduler, for the tests beside this file."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.bench.scenario import Scenario, parse_scenario
from kvbank.engine.bench.vllm_engine import FinishReason, VllmBench, vllm_configs
from kvbank.vllm.settings import Settings

PAGE = 16


def scenario(pages: int, max_seq_len: int = 512, **workload: Any) -> Scenario:
    body = {
        "concurrency": 4,
        "requests": 4,
        "seed": 1,
        "classes": [{"weight": 1, "prompt_tokens": 64, "max_tokens": 32, "output_tokens": 32}],
    }
    body.update(workload)
    return parse_scenario(
        {
            "name": "test",
            "pool": {"pages": pages, "page_size": PAGE},
            "model": {
                "kv_slots": {"main": {"prompt": 1, "output": 1}},
                "max_seq_len": max_seq_len,
                "max_tokens_default": 128,
            },
            "workload": body,
        }
    )


# The two ways vLLM steps a scheduler: --no-async-scheduling, and async scheduling (its default).
MODES = {"sync": False, "async": True}


@functools.lru_cache(maxsize=16)
def _configs(
    pages: int, max_seq_len: int, async_scheduling: bool = False, scheduling: str = "fcfs"
) -> tuple[Any, Any]:
    return vllm_configs(
        scenario(pages, max_seq_len), async_scheduling, scheduling_policy=scheduling
    )


def bench(
    pages: int,
    policy: str | None,
    max_seq_len: int = 512,
    backend: Any = None,
    async_scheduling: bool = False,
    scheduling: str = "fcfs",
    settings: Settings | None = None,
) -> VllmBench:
    """A scheduler over a `pages`-page pool: stock vLLM (policy None) or kvbank's class, stepped
    synchronously or as async scheduling steps it, under vLLM's `scheduling` policy (fcfs or
    priority); `settings` replaces `Settings(policy)`. vLLM's configs are built once per pool
    and mode (a ModelConfig costs a second)."""
    vllm_config, kv_cache_config = _configs(pages, max_seq_len, async_scheduling, scheduling)
    vllm_config.cache_config.num_gpu_blocks = pages
    if settings is None and policy is not None:
        settings = Settings(policy)
    return VllmBench(
        scenario(pages, max_seq_len), settings, backend, (vllm_config, kv_cache_config)
    )


def pressure(scheduling: str) -> dict[int, list[tuple]]:
    """Long best-effort requests fill a 48-page pool; strict ones arrive while they run. Under
    the priority policy the classes come from priorities too, and from tiers that disagree
    with them (a flex request at priority 0, a strict one at priority 9)."""
    arrivals: dict[int, list[tuple]] = {}
    for i in range(4):
        priority = 5 if scheduling == "priority" and i % 2 else 0
        tier = None if priority else "flex"
        arrivals.setdefault(0, []).append((f"be{i}", [50 + i] * 64, 400, 400, tier, priority))
    for i, step in enumerate((10, 30, 60, 90, 120)):
        tier, priority = ("priority", 9) if scheduling == "priority" and i == 2 else (None, 0)
        arrivals[step] = [(f"s{i}", [70 + i] * 128, 128, 128, tier, priority)]
    return arrivals


@dataclass
class Drive:
    """What a driven run saw."""

    finished: dict[str, Any] = field(default_factory=dict)  # rid -> FinishReason
    tokens: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    preempted: dict[str, int] = field(default_factory=dict)  # rid -> times vLLM preempted it
    steps: int = 0


def drive(
    run: VllmBench,
    arrivals: dict[int, list[tuple[Any, ...]]],
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 20000,
    check: bool = True,
    pause_s: float = 0.0,
    on_step: Any = None,
) -> Drive:
    """Step until nothing is left: `arrivals[step]` are (rid, prompt, max_tokens, output
    tokens[, tier[, priority]]) added before that step (VllmBench.add), `aborts[step]` rids
    aborted before it. Checks the ledger
    after every step; raises if the run does not end within `max_steps`. `pause_s` after each
    step stands in for the model's forward pass (a sidecar's reply has that long to arrive).
    `on_step()`, if given, runs after every step's check."""
    seen = Drive()
    aborts = aborts or {}
    last = max([*arrivals, *aborts, 0])
    for step in range(max_steps):
        for args in arrivals.get(step, ()):
            run.add(*args)
        doomed = [rid for rid in aborts.get(step, ()) if rid in run.sched.requests]
        if doomed:
            run.sched.finish_requests(doomed, _aborted())
            for rid in doomed:
                seen.finished[rid] = FinishReason.ABORT
        if step > last and not run.has_work():
            seen.steps = step
            return seen
        totals = run.step()
        if pause_s:
            time.sleep(pause_s)
        seen.preemptions += totals.preempted
        for rid in totals.preempted_ids:
            seen.preempted[rid] = seen.preempted.get(rid, 0) + 1
        if check:
            run.check_integrity()
        if on_step is not None:
            on_step()
        for out in totals.outputs:
            seen.tokens[out.request_id] = seen.tokens.get(out.request_id, 0) + len(
                out.new_token_ids
            )
            if out.finish_reason is not None:
                seen.finished[out.request_id] = out.finish_reason
    raise AssertionError(f"the run did not end in {max_steps} steps: {run.sched.requests}")


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
