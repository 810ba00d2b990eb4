"""The engine with its ledger in a sidecar process behaves exactly as with the embedded ledger."""

from __future__ import annotations

import pytest
from engine_run import run, scenario
from sidecar_harness import spawn_sidecar, stop_process

from kvbank.engine.admission import embedded
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient


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
