"""`KVBANK_ORDER=prefix` in vLLM's real scheduler (CPU, no model): on a pool that holds one
long shared prefix beside its requests but not two, asking the held prefix's requests first
finishes the same work in fewer steps than arrival order, with no preemption and the ledger
checked after every step; with `max_defer_steps` 0 it is arrival order, step for step. The same
over a real `kvbank sidecar`, waited on and as a served vLLM runs it (never waited on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_builders import MODES, PAGE, bench, drive

from kvbank.vllm.scheduler import make_backend
from kvbank.vllm.settings import Settings

pytestmark = pytest.mark.timeout(300)

THRASH = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm-cpu-thrash.yaml"
PREFIX = {"a": [11] * 128, "b": [12] * 128}  # 8 pages of 16 each


def alternating(requests: int = 16) -> dict[int, list[tuple]]:
    """Every request at once, prefixes a and b in turn, each with 16 tokens of its own and 48
    out: 9 pages of prompt, 12 at its end. 28 pages (27 usable) hold one prefix and four
    requests' own 4 pages, or both prefixes and two."""
    arrivals = []
    for i in range(requests):
        prompt = PREFIX["ab"[i % 2]] + [100 + i] * 16
        arrivals.append((f"r{i}", prompt, 48, 48))
    return {0: arrivals}


def run(order: str, mode: str, max_defer_steps: int = 2048) -> tuple:
    settings = Settings("peak+backfill", order=order, max_defer_steps=max_defer_steps)
    scheduler = bench(28, "peak+backfill", async_scheduling=MODES[mode], settings=settings)
    seen = drive(scheduler, alternating())
    return seen, scheduler.sched.kvbank


@pytest.mark.parametrize("mode", MODES)
def test_prefix_order_finishes_a_two_prefix_mix_in_fewer_steps_with_no_preemption(
    mode: str,
) -> None:
    fifo, _ = run("fifo", mode)
    prefix, admission = run("prefix", mode)
    for seen in (fifo, prefix):
        assert seen.preemptions == 0
        assert seen.tokens == {f"r{i}": 48 for i in range(16)}
    assert admission.order.moved > 0
    assert prefix.steps < 0.8 * fifo.steps, (prefix.steps, fifo.steps)


def test_with_no_deferral_allowed_prefix_order_is_arrival_order() -> None:
    fifo, _ = run("fifo", "sync")
    never, admission = run("prefix", "sync", max_defer_steps=0)
    assert admission.order.moved == 0
    assert never.steps == fifo.steps


def run_over(sidecar: str, order: str, blocking: bool, engine_id: str) -> tuple:
    """`run` with the ledger in a real `kvbank sidecar`: waited on (a bench's run), or never
    waited on, as a served vLLM runs (decisions applied a step or more later, the head's hit
    pinned until then), with a pause per step for its replies to arrive in."""
    settings = Settings("peak+backfill", sidecar, token="vllm-property", blocking=blocking,
                        order=order)  # fmt: skip
    backend = make_backend(settings, 28, PAGE, 0, engine_id=engine_id)
    scheduler = bench(28, "peak+backfill", backend=backend, settings=settings)
    admission = scheduler.sched.kvbank
    dropped: list[str] = []  # pinned heads unpinned while still waiting: moved back
    unpin = admission.head_pins.unpin

    def counted(rid: str, *args: Any, **kwargs: Any) -> None:
        if rid in admission.head_pins and rid in admission.waiting:
            dropped.append(rid)
        unpin(rid, *args, **kwargs)

    admission.head_pins.unpin = counted
    seen = drive(scheduler, alternating(), max_steps=60000, pause_s=0 if blocking else 0.001)
    assert backend.outstanding() == 0 and backend.sessions_opened == 1
    return seen, scheduler.sched.kvbank, dropped


def test_over_a_sidecar_waited_on_prefix_order_is_the_embedded_run(sidecar: str) -> None:
    embedded, _ = run("prefix", "sync")
    over, admission, _ = run_over(sidecar, "prefix", True, "order-waits")
    assert admission.order.moved > 0
    assert (over.steps, over.tokens, over.preemptions) == (
        embedded.steps, embedded.tokens, embedded.preemptions
    )  # fmt: skip


def test_over_a_sidecar_never_waited_on_prefix_order_moves_pinned_heads_and_keeps_its_gain(
    sidecar: str,
) -> None:
    """The plug-in reorders only while no report is in flight; a head pinned for the sidecar's
    decision and then moved back loses its pins with its cancel (the ledger checked after every
    step agrees with vLLM's free blocks, so a pin left behind would show)."""
    fifo, _, _ = run_over(sidecar, "fifo", False, "order-fifo")
    prefix, admission, dropped = run_over(sidecar, "prefix", False, "order-prefix")
    for seen in (fifo, prefix):
        assert seen.preemptions == 0
        assert seen.tokens == {f"r{i}": 48 for i in range(16)}
    assert admission.order.moved > 0
    assert dropped, "no pinned head was moved: the unpinning was not exercised"
    assert prefix.steps < 0.8 * fifo.steps, (prefix.steps, fifo.steps)


def test_the_bench_runs_the_prefix_order_as_a_policy_of_its_own() -> None:
    """`kvbank bench --engine vllm --policy vllm+peak+backfill+prefix`: the served thrash
    workload on the virtual clock, with no preemption, sooner than in arrival order."""
    from kvbank.engine.bench.scenario import load_scenario
    from kvbank.engine.bench.vllm_simulate import run_vllm_policy

    scenario = load_scenario(
        Path(__file__).resolve().parents[2] / "benchmarks/vllm-cpu-thrash.yaml"
    )
    fifo = run_vllm_policy(scenario, "vllm+peak+backfill").metrics
    prefix = run_vllm_policy(scenario, "vllm+peak+backfill+prefix").metrics
    for metrics in (fifo, prefix):
        assert (metrics["completed"], metrics["hung"], metrics["preemptions"]) == (64, 0, 0)
    assert prefix["policy"] == "vllm+peak+backfill+prefix"
    # Deterministic: 22.4 s against 29.8 s, TTFT p99 8.7 s against 13.6 s (docs/benchmarks.md)
    assert prefix["duration_s"] < 0.9 * fifo["duration_s"], (prefix, fifo)
    assert prefix["ttft_p99_s"] < fifo["ttft_p99_s"], (prefix, fifo)
