"""Every sidecar policy with an engine that never waits for its sidecar: replies arrive zero to
several polls after each report, decisions are applied when they arrive, and the head's cached
hit is pinned only while no decision is on its way. Random small workloads through the real
engine (debug: the pool's integrity after every step), the real `SidecarBackend` and the real
`AdmissionState` (debug: the ledger's safe state after every report); only the transport is
in-process. No admitted request is ever short of a page (a shortage raises InvariantBreach),
nothing is preempted, nothing stalls, and everything finishes.

Two workloads: strict text requests from a few prefix families (seeded), and the mixed shape
of tests/mixed_workload.py (hypothesis): strict images writing fixed tokens into three labels
beside best-effort chat sharing a system prompt, with host tiers, where the head's pins share
pages with best-effort requests and the second check (engine/safety.py) runs after every
step."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from inprocess import InProcessSidecar
from mixed_workload import BREACH, POOL, SPECS, Spec, mixed_config, run_mixed
from random_workload import drive

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.mode import LEDGER_MODE_NAMES
from kvbank.modelpool import KvSlot
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.state import AdmissionState

SEEDS = int(os.environ.get("DEFERRED_SEEDS", "40"))
DATA = Path(__file__).parent.parent / "data"


def workload(rng: random.Random) -> list[tuple[int, int, int | None, int, int, bool]]:
    """Arrivals over the first steps, prompts from three prefix families (hits, and so pins),
    some with max_tokens, each stopping at a drawn length."""
    return [
        (rng.randint(0, 12), rng.randint(1, 30), rng.choice([None, rng.randint(1, 20)]),
         rng.randint(1, 24), rng.randint(0, 2), True)
        for _ in range(rng.randint(1, 14))
    ]  # fmt: skip


# Seeded rather than hypothesis-drawn: a pin that races a decision on its way needs one exact
# interleaving, which these seeds reach (every policy fails within them when the engine pins
# without waiting for `settled`), and hypothesis' search for small examples rarely does.
@pytest.mark.parametrize("policy", ["banker", "peak", "peak+backfill", "banker+backfill"])
def test_late_decisions_keep_every_promise(policy: str) -> None:
    for seed in range(SEEDS):
        rng = random.Random(seed)
        model = CapacityModel({"main": KvSlot(1, 1)}, 4, 48, 16, rng.randint(0, 2))
        pages = rng.randint(8, 40)
        state = AdmissionState(pool_pages=pages, debug=True, policy=policy)
        client = InProcessSidecar(state, functools.partial(rng.randint, 0, 3))
        backend = SidecarBackend(client, pages, blocking=False)
        budget = rng.randint(2, 40)
        config = EngineConfig(model, pages, policy=policy, max_batch_tokens=budget, debug=True)
        runner = VirtualRunner()
        engine = Engine(config, runner, backend)
        admitted, outputs = drive(engine, runner, workload(rng), max_steps=4000)
        assert {out.rid for out in outputs} == admitted, seed
        assert engine.kv.pool.held == 0, seed
        assert engine.sched.stats.preemptions == 0, seed
        assert backend.books.stalled_steps == 0, seed
        assert state.ledger is not None and state.ledger.stalled_steps == 0, seed
        assert client.reports > 0


def late_mixed(policy: str, lag: int, specs: list[Spec], pool: dict[str, int]) -> None:
    state = AdmissionState(pool_pages=pool["pages"], debug=True, policy=policy)
    client = InProcessSidecar(state, functools.partial(random.Random(lag).randint, 0, 3))
    backend = SidecarBackend(client, pool["pages"], blocking=False)
    run_mixed(mixed_config(policy, **pool), specs, backend)  # all finish, no strict preempted
    assert backend.books.stalled_steps == 0
    assert state.ledger is not None and state.ledger.stalled_steps == 0


@pytest.mark.parametrize("policy", LEDGER_MODE_NAMES)
def test_a_strict_admission_that_arrives_at_a_full_running_set_takes_a_best_effort_row(
    policy: str,
) -> None:
    """The case in tests/data/mixed_deferred_rows.json: best-effort chat started into the rows
    while the answer that admits strict requests was on its way (the engine once raised "admitted
    beyond the room"), and a request preempted after its output began resumed with its prompt
    cached, which the engine took for a finished prefill and reported stalled."""
    case = json.loads((DATA / "mixed_deferred_rows.json").read_text())
    specs = [
        (a, kind, own, top, stop, tuple(fixed)) for a, kind, own, top, stop, fixed in case["specs"]
    ]
    late_mixed(policy, case["lag"], specs, case["pool"])


@pytest.mark.parametrize("policy", LEDGER_MODE_NAMES)
@settings(max_examples=20, deadline=None)
@example(pages=19, host_pages=0, budget=8, speculative=1, max_preemptions=1, lag=0, specs=BREACH)
@given(lag=st.integers(0, 2**16), specs=SPECS, **POOL)
def test_late_decisions_keep_every_strict_promise_beside_best_effort_chat(
    policy: str, lag: int, specs: list[Spec], **pool: int
) -> None:
    late_mixed(policy, lag, specs, pool)
