"""`vllm serve` with kvbank's scheduler class over a real `kvbank sidecar` process: the ledger
lives in the sidecar and vLLM's engine asks it at every schedule."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import MODEL_NAME, VllmServer, start_all

from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(600)

BLOCKS = 16


@pytest.fixture(scope="module")
def server(
    model_dir: Path, sidecar: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-serve-sidecar") / "kvbank-sidecar.log"
    env = {"KVBANK_POLICY": "peak+backfill", "KVBANK_SIDECAR": sidecar}
    (started,) = start_all(
        [VllmServer(model_dir, log, kvbank=True, blocks=BLOCKS, max_model_len=1920, env=env)]
    )
    yield started
    started.stop()


def test_a_completion_is_admitted_by_the_sidecars_ledger(server: VllmServer, sidecar: str) -> None:
    assert "Using custom scheduler class kvbank.vllm.KvbankScheduler" in server.log_text()
    reply = server.client.completions.create(
        model=MODEL_NAME, prompt="the page cache", max_tokens=16, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 16
    # The release goes with the engine's next report, which it sends without waiting for the
    # answer (the schedule after the request finished): it may reach the sidecar just after
    # the reply reaches the client, well within the session's lease.
    deadline = time.monotonic() + 5
    with SidecarClient(sidecar) as client:
        while (status := client.status_reply()).pool.outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
    assert status.session != 0  # vLLM's engine holds a session
    assert status.pool.total_pages == BLOCKS
    assert status.next_seq > 0  # the sidecar logged the admission
    assert status.pool.outstanding == 0, status  # and the release: nothing is left held
