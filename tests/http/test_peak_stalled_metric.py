"""The peak ledger's stalled-step count reaches the engine's /metrics and `kvbank bench --json`."""

from __future__ import annotations

from pathlib import Path

from kvbank.capacity import CapacityModel
from kvbank.engine.admission.ledger_policy import LedgerPolicy
from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.ledger.client import EmbeddedClient
from kvbank.modelpool import KvSlot

STALLED = "kvbank_peak_stalled_steps_total"


def test_a_step_in_which_a_running_request_did_not_advance_is_counted() -> None:
    model = CapacityModel({"main": KvSlot(1, 1)}, 4, 48, 16, 0)
    engine = Engine(EngineConfig(model, 40, policy="peak", debug=True), VirtualRunner())
    metrics = ServeMetrics(40)
    engine.add_request("r0", list(range(8)), 16)
    metrics.observe_step(engine, engine.step())
    assert metrics.registry.get_sample_value(STALLED) == 0.0
    policy = engine.policy
    assert isinstance(policy, LedgerPolicy) and isinstance(policy.backend, EmbeddedClient)
    # A step closed with no progress reported: the ledger's bound broke for r0.
    assert policy.backend.end_step().stalled == ["r0"]
    metrics.observe_step(engine, engine.step())
    assert policy.stalled_steps == 1
    assert metrics.registry.get_sample_value(STALLED) == 1.0
    for _ in range(3):
        metrics.observe_step(engine, engine.step())
    assert metrics.registry.get_sample_value(STALLED) == 1.0  # it advances again: no more
    assert STALLED.encode() in metrics.render()


def test_bench_json_reports_stalled_steps() -> None:
    scenario = load_scenario(
        Path(__file__).parents[1] / "sidecar" / "scenarios" / "shared-prefix.yaml"
    )
    for policy in ("banker", "peak+backfill"):
        assert run_policy(scenario, policy, False, False).metrics["stalled_steps"] == 0
