"""A long mixed run through kvbank's engine over a real `kvbank sidecar --debug` process the
step never waits on (what `kvbank serve --sidecar` runs): strict image requests with fixed label
tokens beside best-effort chat sharing a long system prompt, a host tier, an open loop of 400
requests (scenarios/image-chat-best-effort.yaml). The head's pins share pages with running
requests, best-effort ones among them; the independent safety check (engine/safety.py) runs
after every step. Every request finishes, with no breach, under every ledger policy."""

from __future__ import annotations

import time

import pytest
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.sidecar.backend import connect


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["peak+backfill", "peak", "banker+backfill", "banker"])
def test_a_long_mixed_run_over_a_sidecar_never_waited_on_keeps_every_promise(policy: str) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "image-chat-best-effort.yaml")
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--policy", policy, "--debug")
    try:
        backend = connect(f"127.0.0.1:{port}", scenario.pages, blocking=False, engine_id="mixed")
        # A short pause a step, so that replies arrive a poll or more after their report.
        result = run_policy(
            scenario, policy, backend=backend, check=True, after_step=lambda: time.sleep(0.0003)
        )
    finally:
        stop_process(proc)
    metrics = result.metrics
    assert (metrics["stopped"], metrics["invariant_breaches"]) == ("finished", 0)
    assert metrics["completed"] == scenario.workload.requests
