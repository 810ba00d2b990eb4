"""Random small workloads: with integrity checked after every step (debug mode), the banker never
breaches, never preempts and finishes every admitted request. The baselines that cannot deadlock
(preempt, no-evict, ratio) are held to the same, bar the preemptions."""

from __future__ import annotations

import pytest
from engine_builders import make_engine, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from random_workload import SLOTS, drive, request

from kvbank.engine.request import FinishReason
from kvbank.modelpool import KvSlot


@pytest.mark.parametrize("policy", ["banker", "preempt", "no-evict", "ratio"])
@settings(max_examples=40, deadline=None)
@given(
    pages=st.integers(6, 40),
    slots=st.sampled_from(SLOTS),
    speculative=st.integers(0, 2),
    budget=st.integers(4, 40),
    requests=st.lists(request, min_size=1, max_size=14),
)
def test_no_breach_no_hang_and_the_banker_never_preempts(
    policy: str,
    pages: int,
    slots: dict[str, KvSlot],
    speculative: int,
    budget: int,
    requests: list[tuple[int, int, int | None, int, int, bool]],
) -> None:
    model = tiny_model(
        page_size=4, max_seq_len=48, max_tokens=16, speculative=speculative, slots=slots
    )
    engine, runner = make_engine(pages, policy, model=model, max_batch_tokens=budget)
    admitted, outputs = drive(engine, runner, requests, max_steps=1500)  # debug: deep checks
    assert all(out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for out in outputs)
    finished = {out.rid for out in outputs}
    assert finished == admitted
    assert engine.kv.pool.held == 0
    if policy in ("banker", "no-evict"):
        assert engine.sched.stats.preemptions == 0
    if policy == "banker":
        assert engine.backend is not None and engine.backend.outstanding() == 0
