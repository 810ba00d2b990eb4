"""Random mixes of strict and best-effort requests under kvbank's ledger policies: pools,
shared prefixes, speculative tokens, host tiers, victim rules and preemption bounds.

Every step (debug mode) checks the pool, the index, the host tier and the ledger deeply. On
top: no strict request is ever preempted, and every strict request that was decoding got its
row (it was never stalled or denied a page; a denied page raises in the policy); no request is
preempted more than `max_preemptions` times; everything finishes; and each request's output is
token for token its output in a pool so roomy that nothing is preempted (the runner's values
chain through the KV, so a page reloaded or leased wrong after a preemption would show)."""

from __future__ import annotations

import pytest
from engine_builders import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_host_tier_property import ChainRunner

from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.runner import SamplingParams, StepBatch, StepResult
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim

PAGE_SIZE = 4


class Recorder(ChainRunner):
    def __init__(self) -> None:
        super().__init__()
        self.rows: set[str] = set()

    def run(self, batch: StepBatch) -> StepResult:
        self.rows = {row.rid for row in batch.rows}
        return super().run(batch)


request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 20),  # prompt tokens
    st.integers(2, 20),  # max_tokens
    st.integers(1, 24),  # where the model would stop
    st.sampled_from([0, 1, 2]),  # prompt family: shared prefixes make hits
    st.booleans(),  # best-effort (a group of sequences runs strict whatever it asks)
    st.sampled_from([1, 1, 1, 2]),  # sequences from the prompt (OpenAI's n)
)
Spec = tuple[int, int, int, int, int, bool, int]


def _run(
    config: EngineConfig, requests: list[Spec], check: bool
) -> tuple[dict[str, list[int]], Engine]:
    runner = Recorder()
    engine = Engine(config, runner)
    outputs: dict[str, list[int]] = {}
    arrivals = sorted(enumerate(requests), key=lambda item: item[1][0])
    strict_at_ingest: set[str] = set()
    for step in range(4000):
        while arrivals and arrivals[0][1][0] <= step:
            index, (_, prompt_len, max_tokens, stop, family, flex, n) = arrivals.pop(0)
            prompt = [100 * family + (i % 7) for i in range(prompt_len)]
            cls = ServiceClass.BEST_EFFORT if flex else ServiceClass.STRICT
            rid = f"r{index}"
            siblings = [(f"{rid}.{k}", SamplingParams()) for k in range(1, n)]
            try:
                engine.add_request(rid, prompt, max_tokens, service_class=cls, siblings=siblings)
            except RequestRejected:
                continue
            for seq in [rid, *(sid for sid, _ in siblings)]:
                runner.stop[seq] = stop
                outputs[seq] = []
            if not flex or siblings:
                strict_at_ingest.add(rid)
        if not arrivals and not engine.has_work():
            return outputs, engine
        sched = engine.sched
        decoding = {
            rid
            for rid, req in sched.running.items()
            if not req.best_effort
            and req.group is None  # a group's sequences wait for each other to prime
            and req.num_tokens - req.num_computed == 1
        }
        for out in engine.step():  # debug mode: deep integrity checks after every step
            outputs[out.rid].extend(out.new_token_ids)
        if check:
            assert decoding <= runner.rows, f"strict rows skipped: {decoding - runner.rows}"
            for req in list(sched.running.values()) + list(sched.waiting):
                assert req.preemptions <= config.classes.max_preemptions, req.rid
                if req.rid in strict_at_ingest:
                    assert req.preemptions == 0, f"strict {req.rid} was preempted"
            assert sched.stats.stalled_rows == 0
            # What pickers read: the best-effort queue's pages to start, its hits taken off.
            best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
            most = sum(r.pages_at(r.num_tokens) for r in best_effort.waiting)
            assert 0 <= best_effort.backlog_pages <= most
    raise AssertionError("the workload did not finish in 4000 steps")


@pytest.mark.parametrize("policy", ["peak+backfill", "peak", "banker+backfill", "banker"])
@settings(max_examples=60, deadline=None)
@given(
    pages=st.integers(12, 30),
    host_pages=st.sampled_from([0, 0, 6, 24]),
    budget=st.integers(8, 40),
    speculative=st.integers(0, 2),
    max_preemptions=st.integers(1, 3),
    victim=st.sampled_from(list(Victim)),
    estimate=st.sampled_from(list(Estimate)),
    requests=st.lists(request, min_size=1, max_size=16),
)
def test_strict_requests_keep_their_promise_whatever_best_effort_ones_do(
    policy: str,
    pages: int,
    host_pages: int,
    budget: int,
    speculative: int,
    max_preemptions: int,
    victim: Victim,
    estimate: Estimate,
    requests: list[Spec],
) -> None:
    model = tiny_model(page_size=PAGE_SIZE, max_seq_len=56, max_tokens=20, speculative=speculative)
    classes = ClassPolicy(max_preemptions=max_preemptions, victim=victim, estimate=estimate)
    roomy = EngineConfig(model, 600, policy, budget, classes=classes, debug=True)
    expected, _ = _run(roomy, requests, check=False)
    config = EngineConfig(
        model, pages, policy, budget, host_pages=host_pages, classes=classes, debug=True
    )
    got, engine = _run(config, requests, check=True)
    assert got.keys() <= expected.keys()
    assert {rid: got[rid] for rid in got} == {rid: expected[rid] for rid in got}
    assert engine.kv.pool.held == 0 and engine.kv.strict_held == 0
    assert engine.policy.best_effort.backlog_pages == 0  # type: ignore[attr-defined]
    assert getattr(engine.policy, "stalled_steps", 0) == 0
    SEEN["preempted"] += engine.sched.stats.preemptions
    SEEN["promoted"] += engine.policy.best_effort.promoted  # type: ignore[attr-defined]
    SEEN["runs"] += 1


SEEN = {"preempted": 0, "promoted": 0, "runs": 0}


def test_the_property_saw_preemptions_and_promotions() -> None:
    """The random mixes above did preempt and promote (run after them, in file order)."""
    if SEEN["runs"]:
        assert SEEN["preempted"] > 0 and SEEN["promoted"] > 0, SEEN
