"""The peak-fit policies through the real engine on the virtual runner: random small workloads
with the engine's deep integrity check after every step (debug mode). No admitted request is
ever short of a page (the policy raises InvariantBreach on a shortage), nothing is preempted,
every request finishes, and no step breaks the every-request-advances assumption."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_workload import SLOTS, drive, request

from kvbank.capacity import CapacityModel
from kvbank.engine.admission.ledger_policy import LedgerPolicy
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.modelpool import KvSlot


def engine_for(
    pages: int, policy: str, model: CapacityModel, budget: int
) -> tuple[Engine, VirtualRunner]:
    runner = VirtualRunner()
    config = EngineConfig(model, pages, policy=policy, max_batch_tokens=budget, debug=True)
    return Engine(config, runner), runner


@pytest.mark.parametrize("policy", ["peak", "peak+backfill", "banker+backfill"])
@settings(max_examples=int(os.environ.get("PEAK_EXAMPLES", "40")), deadline=None)
@given(
    pages=st.integers(6, 40),
    slots=st.sampled_from(SLOTS),
    speculative=st.integers(0, 2),
    budget=st.integers(2, 40),
    requests=st.lists(request, min_size=1, max_size=14),
)
def test_no_breach_no_preemption_no_stall_and_everything_finishes(
    policy: str,
    pages: int,
    slots: dict[str, KvSlot],
    speculative: int,
    budget: int,
    requests: list[tuple[int, int, int | None, int, int, bool]],
) -> None:
    model = CapacityModel(slots, 4, 48, 16, speculative)
    engine, runner = engine_for(pages, policy, model, budget)
    admitted, outputs = drive(engine, runner, requests, max_steps=3000)
    finished = {out.rid for out in outputs}
    assert finished == admitted
    assert engine.kv.pool.held == 0
    assert engine.sched.stats.preemptions == 0
    policy_obj = engine.policy
    assert isinstance(policy_obj, LedgerPolicy)
    assert policy_obj.stalled_steps == 0


def test_peak_runs_more_at_once_and_finishes_sooner_than_the_banker() -> None:
    # 29 usable pages of 4 tokens. Every 4 steps a request of 8 prompt tokens that may write 40
    # more (12 pages worst) but stops earlier, at staggered lengths. The banker never holds more
    # than 2 at once (24 of 29 pages); peak-fit admits a request while the running ones are
    # far enough along that their pages come back before its own bound needs them.
    model = CapacityModel({"main": KvSlot(1, 1)}, 4, 64, 40, 0)
    stops = [5, 38, 12, 30, 7, 25, 40, 9, 33, 15, 20, 11]
    seen = {}
    for policy in ("banker", "peak"):
        engine, runner = engine_for(30, policy, model, 256)
        most = 0
        for step in range(400):
            if step % 4 == 0 and step // 4 < len(stops):
                i = step // 4
                engine.add_request(f"r{i}", [i * 10 + j % 7 for j in range(8)], 40)
                runner.stop_after(f"r{i}", stops[i])
            if step // 4 >= len(stops) and not engine.has_work():
                break
            engine.step()  # debug mode: integrity after every step
            most = max(most, engine.num_running)
        seen[policy] = (most, step)
        assert engine.sched.stats.preemptions == 0
    assert seen == {"banker": (2, 127), "peak": (4, 94)}
