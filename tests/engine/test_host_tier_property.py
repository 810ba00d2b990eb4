"""Random workloads over a host tier: every page that comes back from host is the page that
went out. The runner here has a memory: the value it writes at a position is a hash of the
value at the position before (read from that position's page) and the position's token, and
the token it samples is drawn from the last value. So wrong KV anywhere (a reload into the
wrong page, a slot reused too early, a prefix hit on the wrong chain) changes every later
token of that request, and each request's output must equal its output in a pool so roomy
that nothing is ever evicted or preempted."""

from __future__ import annotations

import pytest
from engine_builders import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.kv.host import Direction
from kvbank.engine.runner import StepBatch, StepResult

EOS = 1
PAGE_SIZE = 4


class ChainRunner:
    eos_token_id = EOS

    def __init__(self) -> None:
        self.device: dict[tuple[int, int], int] = {}  # (page, offset) -> value
        self.host: dict[tuple[int, int], int] = {}  # (slot, offset) -> value
        self.stop: dict[str, int] = {}
        self.sampled: dict[str, int] = {}

    def run(self, batch: StepBatch) -> StepResult:
        for move in batch.moves:
            for offset in range(PAGE_SIZE):
                if move.direction is Direction.TO_HOST:
                    self.host[move.slot, offset] = self.device.get((move.page, offset), -1)
                else:
                    self.device[move.page, offset] = self.host.get((move.slot, offset), -1)
        tokens: dict[str, int] = {}
        for row in batch.rows:
            value = 0
            for i, token in enumerate(row.token_ids):
                position = row.start_pos + i
                before = position - 1
                previous = (
                    self.device.get((row.page_ids[before // PAGE_SIZE], before % PAGE_SIZE), -1)
                    if position
                    else 0
                )
                value = hash((previous, token)) & 0xFFFFFFFF
                self.device[row.page_ids[position // PAGE_SIZE], position % PAGE_SIZE] = value
            if row.sample:
                count = self.sampled[row.rid] = self.sampled.get(row.rid, 0) + 1
                tokens[row.rid] = EOS if count >= self.stop[row.rid] else 2 + value % 50
        return StepResult(tokens, 0.001)

    def release(self, rid: str) -> None:
        self.sampled.pop(rid, None)


request = st.tuples(
    st.integers(0, 10),  # arrival step
    st.integers(1, 30),  # prompt tokens
    st.integers(2, 20),  # max_tokens
    st.integers(1, 24),  # where the model would stop
    st.sampled_from([0, 1, 2]),  # prompt family: shared prefixes make hits
)


def _engine(config: EngineConfig) -> tuple[Engine, ChainRunner]:
    runner = ChainRunner()
    return Engine(config, runner), runner


def _outputs(
    engine: Engine, runner: ChainRunner, requests: list[tuple[int, int, int, int, int]]
) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    arrivals = sorted(enumerate(requests), key=lambda item: item[1][0])
    for step in range(3000):
        while arrivals and arrivals[0][1][0] <= step:
            index, (_, prompt_len, max_tokens, stop, family) = arrivals.pop(0)
            prompt = [100 * family + (i % 7) for i in range(prompt_len)]
            try:
                engine.add_request(f"r{index}", prompt, max_tokens)
            except RequestRejected:
                continue
            runner.stop[f"r{index}"] = stop
            outputs[f"r{index}"] = []
        if not arrivals and not engine.has_work():
            return outputs
        for out in engine.step():
            outputs[out.rid].extend(out.new_token_ids)
    raise AssertionError("the workload did not finish in 3000 steps")


@pytest.mark.parametrize("policy", ["preempt", "ratio", "banker", "peak+backfill"])
@settings(max_examples=30, deadline=None)
@given(
    pages=st.integers(10, 30),
    host_pages=st.integers(1, 24),
    budget=st.integers(8, 40),
    requests=st.lists(request, min_size=1, max_size=10),
)
def test_reloaded_pages_are_the_pages_that_were_evicted(
    policy: str,
    pages: int,
    host_pages: int,
    budget: int,
    requests: list[tuple[int, int, int, int, int]],
) -> None:
    model = tiny_model(page_size=PAGE_SIZE, max_seq_len=48, max_tokens=16)
    roomy, roomy_runner = _engine(EngineConfig(model, 400, policy, budget, debug=True))
    expected = _outputs(roomy, roomy_runner, requests)
    config = EngineConfig(model, pages, policy, budget, host_pages=host_pages, debug=True)
    tight, runner = _engine(config)
    got = _outputs(tight, runner, requests)  # debug mode: deep checks, host tier included
    assert {rid: got[rid] for rid in expected if rid in got} == {
        rid: expected[rid] for rid in got if rid in expected
    }
    assert tight.kv.pool.held == 0
