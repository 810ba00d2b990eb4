"""The engine with its ledger in a sidecar process behaves exactly as with the embedded ledger."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from engine_run import SCENARIOS, run, scenario
from sidecar_harness import bench_both_ways, spawn_sidecar, stop_process

from kvbank.ledger.client import embedded
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient, SidecarError


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "requests", "concurrency"),
    [("shared-prefix", 24, 16), ("image-chat-stress", 8, 8)],
)
def test_a_scenario_admits_and_completes_the_same_way_embedded_and_over_grpc(
    name: str, requests: int, concurrency: int
) -> None:
    sc = scenario(name, requests, concurrency)
    local = run(sc, embedded(sc.pages, debug=True))
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug")
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            backend = SidecarBackend(client, sc.pages, blocking=True)
            remote = run(sc, backend)
            assert backend.sessions_opened == 1
            status = client.status()
    finally:
        stop_process(proc)
    assert len(local.completions) == requests
    assert len(set(local.admitted)) == requests  # every request admitted once
    assert remote.admitted == local.admitted
    assert remote.completions == local.completions
    assert remote.steps == local.steps
    assert (status.running, status.waiting, status.outstanding) == (0, 0, 0)


class StartOrder:
    """Wraps a peak backend to record admissions in the order the engine starts them."""

    def __init__(self, backend: Any, record: list[str]) -> None:
        self._backend = backend
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def try_admit(self, rid: str, hit: Any, prefill_chunks: int | None = None) -> Any:
        decision = self._backend.try_admit(rid, hit, prefill_chunks)
        if decision is not None:
            self._record.append(decision.rid)
        return decision


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("policy", "name", "requests", "concurrency"),
    [
        ("peak", "shared-prefix", 24, 16),
        ("peak+backfill", "shared-prefix", 24, 16),
        pytest.param(  # backfill starts chat-8 before image-7
            "peak+backfill", "image-chat-stress", 12, 12, marks=pytest.mark.slow
        ),
    ],
)
def test_peak_fit_admits_and_completes_the_same_way_embedded_and_over_grpc(
    policy: str, name: str, requests: int, concurrency: int
) -> None:
    sc = scenario(name, requests, concurrency)
    order: dict[str, list[str]] = {"local": [], "remote": []}
    local = run(sc, StartOrder(embedded(sc.pages, debug=True), order["local"]), policy=policy)
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug", "--policy", policy)
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            backend = SidecarBackend(client, sc.pages, blocking=True)
            remote = run(sc, StartOrder(backend, order["remote"]), policy=policy)
            assert backend.sessions_opened == 1
            status = client.status()
            served = client.status_reply()
    finally:
        stop_process(proc)
    assert len(local.completions) == requests
    assert sorted(order["local"]) == sorted(local.completions)  # every request admitted once
    assert order["remote"] == order["local"]
    assert remote.completions == local.completions
    assert remote.steps == local.steps
    assert (status.running, status.waiting, status.outstanding) == (0, 0, 0)
    assert served.next_seq == requests  # every admission was the sidecar's decision
    if name == "image-chat-stress":
        assert order["remote"].index("chat-8") < order["remote"].index("image-7")


@pytest.mark.timeout(60)
def test_an_engine_asking_for_another_policy_than_the_sidecar_runs_is_refused() -> None:
    sc = scenario("shared-prefix", 4, 4)
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--policy", "peak")
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            backend = SidecarBackend(client, sc.pages, blocking=True)
            with pytest.raises(SidecarError) as err:
                run(sc, backend, policy="peak+backfill")
    finally:
        stop_process(proc)
    assert err.value.code == "FAILED_PRECONDITION"
    assert "peak+backfill" in err.value.message and "--policy" in err.value.message


@pytest.mark.timeout(150)
@pytest.mark.parametrize("policy", ["banker", "peak"])
def test_kvbank_bench_with_a_sidecar_prints_the_embedded_figures(policy: str) -> None:
    scenario_file = str(SCENARIOS / "shared-prefix.yaml")
    local, remote, served = bench_both_ways(
        ["--scenario", scenario_file, "--policy", policy, "--json"],
        ["--metrics-port", "-1", "--policy", policy],
    )
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    assert json.loads(local.stdout)[0]["completed"] == 32
    assert served.session != 0 and served.next_seq == 32  # the decisions were the sidecar's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["banker", "peak", "peak+backfill"])
def test_the_non_blocking_backend_applies_decisions_a_step_later_and_loses_nothing(
    policy: str,
) -> None:
    sc = scenario("shared-prefix", 24, 16)
    local = run(sc, embedded(sc.pages, debug=True), policy=policy)
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug", "--policy", policy)
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            backend = SidecarBackend(client, sc.pages, blocking=False)
            # A virtual step takes microseconds, a loopback reply about a millisecond; a model's
            # forward pass takes more. Half a millisecond a step lets replies arrive in steps.
            remote = run(sc, backend, on_step=lambda step: time.sleep(0.0005), policy=policy)
            backend.flush()  # the last releases wait for a poll the idle engine never makes
            status = client.status()
            served = client.status_reply()
    finally:
        stop_process(proc)
    # Decisions arrive later in engine steps, so timing differs; what finishes must not.
    assert remote.completions == local.completions
    assert sorted(remote.admitted) == sorted(local.completions)  # each admitted once
    assert remote.steps >= local.steps
    assert (status.running, status.waiting, status.outstanding) == (0, 0, 0)
    assert backend.books.stalled_steps == 0  # a late start is never taken for a stall
    assert served.next_seq == 24  # every admission was the sidecar's decision
