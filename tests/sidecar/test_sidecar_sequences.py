"""Groups of n sequences with the ledger in a real sidecar process: one reservation per group,
blocking and deferred, books right at the end (the sidecar runs with --debug)."""

from __future__ import annotations

import functools
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from inprocess import InProcessSidecar
from sidecar_harness import spawn_sidecar, stop_process

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import EngineConfig, RequestRejected
from kvbank.ledger.client import embedded
from kvbank.modelpool import KvSlot
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient
from kvbank.sidecar.state import AdmissionState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_builders import make_engine

from kvbank.engine.engine import Engine
from kvbank.engine.runner import SamplingParams

PAGES = 40


def workload(engine: Engine) -> None:
    for i in range(6):
        prompt = list(range(1 + i, 11 + 3 * i))
        others = [(f"g{i}/{j}", SamplingParams(seed=j)) for j in range(1, 1 + i % 4)]
        engine.add_request(f"g{i}", prompt, 5 + i, siblings=others)


def finish(engine: Engine) -> tuple[dict[str, int], int]:
    tokens: dict[str, int] = {}
    for _ in range(3000):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens[out.rid] = tokens.get(out.rid, 0) + len(out.new_token_ids)
        if engine.last_rows == 0:
            time.sleep(0.002)  # a deferred decision is on its way, as the serve loop waits
    assert not engine.has_work()
    return tokens, engine.steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["banker", "peak+backfill"])
@pytest.mark.parametrize("blocking", [True, False])
def test_groups_run_over_a_sidecar_as_they_do_embedded(policy: str, blocking: bool) -> None:
    local_engine, _ = make_engine(PAGES, policy, backend=embedded(PAGES, debug=True))
    workload(local_engine)
    local, _ = finish(local_engine)
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug", "--policy", policy)
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            backend = SidecarBackend(client, PAGES, blocking=blocking)
            engine, _ = make_engine(PAGES, policy, backend=backend)
            workload(engine)
            remote, _ = finish(engine)
            backend.flush()
            status = client.status()
    finally:
        stop_process(proc)
    expected = {f"g{i}": 5 + i for i in range(6)}
    expected.update({f"g{i}/{j}": 5 + i for i in range(6) for j in range(1, 1 + i % 4)})
    assert local == expected
    assert remote == expected
    assert (status.running, status.waiting, status.outstanding) == (0, 0, 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["banker", "peak", "peak+backfill", "banker+backfill"])
def test_late_decisions_keep_every_groups_promise(policy: str) -> None:
    """Groups among lone requests, prefixes shared (hits, pins), replies zero to three polls
    late, against the real AdmissionState in debug mode: nothing runs short, stalls or is
    preempted, and every sequence finishes."""
    model = CapacityModel({"main": KvSlot(1, 1)}, 4, 64, 16, 0)
    for seed in range(300):
        rng = random.Random(seed)
        pages = rng.randint(12, 40)
        state = AdmissionState(pool_pages=pages, debug=True, policy=policy)
        client = InProcessSidecar(state, functools.partial(rng.randint, 0, 3))
        backend = SidecarBackend(client, pages, blocking=False)
        config = EngineConfig(model, pages, policy=policy, max_batch_tokens=rng.randint(4, 24))
        runner = VirtualRunner()
        engine = Engine(replace(config, debug=True), runner, backend)
        arrivals = sorted((rng.randint(0, 10), i) for i in range(rng.randint(1, 8)))
        accepted: set[str] = set()
        finished: set[str] = set()
        for step in range(3000):
            while arrivals and arrivals[0][0] <= step:
                _, i = arrivals.pop(0)
                family = rng.randint(0, 2)
                prompt = [100 * family + (k % 9) for k in range(rng.randint(1, 20))]
                ids = [f"r{i}", *(f"r{i}/{j}" for j in range(1, rng.randint(1, 7)))]
                try:
                    engine.add_request(
                        ids[0],
                        prompt,
                        rng.randint(1, 12),
                        siblings=[(rid, SamplingParams()) for rid in ids[1:]],
                    )
                except RequestRejected:
                    continue
                for rid in ids:
                    runner.stop_after(rid, rng.randint(1, 14))
                accepted.update(ids)
            if not arrivals and not engine.has_work():
                break
            finished.update(out.rid for out in engine.step() if out.finished)
        assert finished == accepted, seed
        assert engine.kv.pool.held == 0, seed
        assert engine.sched.stats.preemptions == 0, seed
        assert backend.books.stalled_steps == 0, seed
        assert state.ledger is not None and state.ledger.stalled_steps == 0, seed
