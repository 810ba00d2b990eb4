"""benchmarks/vllm_offline.py without vLLM: the mix it sends, the ideal steps it measures the
engines against, the ratios it prints, and its arguments."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

offline = load_benchmark("vllm_offline")
served = load_benchmark("vllm_cpu")


def test_the_mix_is_the_served_thrash_workload_as_token_ids() -> None:
    mix = offline.thrash_mix(64)
    data = served.WORKLOADS["thrash"].data
    prefix = data["prefix_tokens"]
    assert [r.prefix for r in mix[:4]] == [0, 1, 0, 1]
    for r in mix:
        own = len(r.prompt) - prefix
        assert data["prompt_tokens_min"] <= own <= data["prompt_tokens_max"]
        assert data["output_tokens_min"] <= r.output <= data["output_tokens_max"]
        assert r.prompt[:prefix] == mix[r.prefix].prompt[:prefix]
        assert r.prompt[0] == 1 and all(0 <= t < offline.VOCAB for t in r.prompt)
    assert mix[0].prompt[:prefix] != mix[1].prompt[:prefix]
    assert offline.thrash_mix(64) == mix  # seeded: every round sends the same requests


def test_own_blocks_grow_one_token_a_step_after_the_prompt() -> None:
    # 1,024 + 100 prompt tokens: the 9th block holds tokens 1,025-1,152, so one own block
    # through age 28 (1,152 tokens written), two from age 29.
    request = offline.Request(0, tuple([1] * 1124), 40)
    assert [offline.own_blocks(request, age) for age in (0, 28, 29, 39)] == [1, 1, 2, 2]


def hand_mix() -> list:
    """Three requests of one own block for 20 steps: prefix 0, prefix 1, prefix 0."""
    return [offline.Request(p, tuple([1] * 1124), 20) for p in (0, 1, 0)]


def test_exact_schedules_on_a_pool_that_holds_one_prefix_and_two_requests() -> None:
    # 18 blocks, 17 usable: prefix 0 with r0 and r2 is 10; r1 needs its prefix too (9 more).
    fifo, first_fit, prefix = (offline.exact_schedule(hand_mix(), 18, o) for o in offline.ORDERS)
    assert fifo.starts == (0, 20, 40) and fifo.steps == 60  # r2 waits behind r1
    assert first_fit.starts == (0, 20, 0) and first_fit.steps == 40
    assert prefix.starts == (0, 20, 0) and prefix.longest_wait == 20
    # 26 blocks hold both prefixes and all three at once.
    assert offline.exact_schedule(hand_mix(), 26, "fifo").starts == (0, 0, 0)
    with pytest.raises(ValueError, match="9 blocks never hold request 0"):
        offline.exact_schedule(hand_mix(), 9, "fifo")


@pytest.mark.parametrize("order", offline.ORDERS)
def test_exact_schedules_keep_the_pool_at_every_step(order: str) -> None:
    """Recounted from the starts alone: each prefix's blocks once while a request of it runs,
    and every request's own blocks, within the usable pool at every step."""
    mix = offline.thrash_mix(12, seed=3)
    blocks = 24
    schedule = offline.exact_schedule(mix, blocks, order)
    ends = [start + r.output for start, r in zip(schedule.starts, mix, strict=True)]
    assert schedule.steps == max(ends)
    for step in range(schedule.steps):
        running = [
            r for r, start, end in zip(mix, schedule.starts, ends, strict=True)
            if start <= step < end
        ]  # fmt: skip
        held = 8 * len({r.prefix for r in running})
        own = sum(
            offline.own_blocks(r, step - start)
            for r, start, end in zip(mix, schedule.starts, ends, strict=True)
            if start <= step < end
        )
        assert held + own <= blocks - 1, (order, step)
    if order == "fifo":
        assert list(schedule.starts) == sorted(schedule.starts)


def test_on_the_thrash_mix_holding_one_prefix_at_a_time_packs_best() -> None:
    mix = offline.thrash_mix(32)  # with fewer, first-fit happens to keep one prefix too
    fifo, first_fit, prefix = (offline.exact_schedule(mix, 24, o) for o in offline.ORDERS)
    assert prefix.steps < first_fit.steps < fifo.steps
    assert prefix.longest_wait < first_fit.longest_wait < fifo.longest_wait


def test_ratios_split_throughput_into_packing_and_time_per_step() -> None:
    stock = offline.Run("stock", 10.0, 1000, 3.9, 7, 60, scheduler_s=0.9)
    kvbank = offline.Run("kvbank", 16.0, 1250, 3.3, 5, 0, scheduler_s=2.0)
    got = offline.ratios(stock, kvbank)
    assert got == {"throughput": 0.625, "packing": 0.8, "time_per_step": 0.781,
                   "scheduler_ms_added": 0.7}  # fmt: skip
    assert got["packing"] * got["time_per_step"] == pytest.approx(got["throughput"], abs=1e-3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--requests", "0"], "at least 1"), (["--rounds", "0"], "at least 1")],
)
def test_bad_arguments_say_what_to_change(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        offline.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_pool_that_never_holds_a_request_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        offline.parse_args(["--blocks", "9", "--requests", "4"])
    assert "--blocks 9: 9 blocks never hold request 0 of the mix" in capsys.readouterr().err
