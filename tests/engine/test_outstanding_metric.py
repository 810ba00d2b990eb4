"""`kvbank_outstanding_pages` under every policy, with the ledger embedded or in a real sidecar:
while admitted requests hold pages and may take more, the gauge shows what they may still take."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbank.engine.admission.policy import policy_names
from kvbank.engine.engine import Engine
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient
from tests.engine.engine_builders import make_engine
from tests.sidecar.sidecar_harness import spawn_sidecar, stop_process

PAGES = 64
LEDGER_POLICIES = ("banker", "banker+backfill", "peak", "peak+backfill")


def still_to_take(engine: Engine) -> int:
    """What the running requests may still take, from the engine's own requests (the prompts
    share no prefix, so each one's held pages are its own)."""
    return sum(r.worst - r.held for r in engine.sched.running.values())


def run_a_few_steps(engine: Engine, metrics: ServeMetrics) -> list[tuple[int, int]]:
    """(gauge, expected) after each of a few steps with requests running."""
    for i in range(3):
        engine.add_request(f"r{i}", [100 * i + t for t in range(6)], max_tokens=12)
    seen = []
    for _ in range(6):
        outputs = engine.step()
        metrics.observe_step(engine, outputs)
        if engine.num_running:
            seen.append((int(metrics.outstanding_pages._value.get()), still_to_take(engine)))
    return seen


@pytest.mark.parametrize("policy", policy_names())
def test_embedded(policy: str) -> None:
    engine, _ = make_engine(PAGES, policy)
    seen = run_a_few_steps(engine, ServeMetrics(PAGES))
    assert seen, "no request ran"
    assert all(gauge == expected for gauge, expected in seen), seen
    assert any(gauge > 0 for gauge, _ in seen), seen


@pytest.fixture(scope="module")
def sidecar_address() -> Iterator[str]:
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug")
    yield f"127.0.0.1:{port}"
    stop_process(proc)


@pytest.mark.parametrize("policy", LEDGER_POLICIES)
def test_sidecar(policy: str, sidecar_address: str) -> None:
    backend = SidecarBackend(SidecarClient(sidecar_address), PAGES, engine_id=policy)
    engine, _ = make_engine(PAGES, policy, backend=backend)
    seen = run_a_few_steps(engine, ServeMetrics(PAGES))
    assert seen, "no request ran"
    # Decisions reach the engine a report after they are made; once applied, the gauge agrees.
    assert seen[-1][0] == seen[-1][1] > 0, seen
    backend.flush()
    assert backend.client.status().outstanding == seen[-1][0]
