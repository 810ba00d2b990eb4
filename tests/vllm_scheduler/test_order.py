"""`KVBANK_ORDER=prefix` in vLLM's real scheduler (CPU, no model): on a pool that holds one
long shared prefix beside its requests but not two, asking the held prefix's requests first
finishes the same work in fewer steps than arrival order, with no preemption and the ledger
checked after every step; with `max_defer_steps` 0 it is arrival order, step for step."""

from __future__ import annotations

import pytest
from vllm_builders import MODES, bench, drive

from kvbank.vllm.settings import Settings

pytestmark = pytest.mark.timeout(300)

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
