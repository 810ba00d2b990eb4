"""`vllm serve` with kvbank's scheduler class over a `kvbank sidecar` on a Unix socket, as the
operator's pods run it, when the sidecar dies (SIGKILL) under load and comes back on the same
socket, as the kubelet restarts it: nothing is lost. Running requests keep their pages and
finish, waiting ones wait for the new sidecar, which re-registers what still runs, and every
request gets all its tokens with no preemption. A module of its own: it kills its sidecar."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_server import MODEL_NAME, VllmServer, start_all

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient
from kvbank.vllm.scheduler import OUTAGE_EFFECT
from tests.sidecar.sidecar_harness import spawn_sidecar, stop_process

pytestmark = pytest.mark.timeout(600)

BLOCKS = 16
REQUESTS, MAX_TOKENS = 10, 300  # 3 blocks each at their end: 30 wanted of 15, so some wait


class Sidecar:
    """The sidecar process on one Unix socket, killed and started again on it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc, _, _ = spawn_sidecar("--listen", self.address, "--metrics-port", "-1", "--debug")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        stop_process(self.proc)  # closes its pipes

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    started = Sidecar(f"unix://{tmp_path_factory.mktemp('fault')}/admission.sock")
    started.start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def server(
    model_dir: Path, sidecar: Sidecar, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-serve-fault") / "kvbank-fault.log"
    env = {"KVBANK_POLICY": "peak+backfill", "KVBANK_SIDECAR": sidecar.address}
    (started,) = start_all(
        [VllmServer(model_dir, log, kvbank=True, blocks=BLOCKS, max_model_len=1920, env=env)]
    )
    yield started
    started.stop()


def status(address: str) -> pb.StatusReply:
    with SidecarClient(address) as client:
        return client.status_reply()


def test_a_sidecar_killed_under_load_and_restarted_loses_no_request(
    server: VllmServer, sidecar: Sidecar
) -> None:
    def one(i: int) -> list[int]:
        reply = server.client.completions.create(
            model=MODEL_NAME,
            prompt=f"{i} the page cache {i}",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(getattr(reply.choices[0], "token_ids", None) or [])

    before = server.metric("vllm:num_preemptions_total")
    with ThreadPoolExecutor(REQUESTS) as pool:
        replies = [pool.submit(one, i) for i in range(REQUESTS)]
        # Killed while its ledger has admitted requests running and others waiting.
        deadline = time.monotonic() + 60
        while not ((now := status(sidecar.address)).running and now.waiting):
            assert time.monotonic() < deadline, f"the pool never filled: {now}"
            assert not any(r.done() for r in replies), "a request finished before the kill"
            time.sleep(0.02)
        sidecar.kill()
        time.sleep(1.0)  # the outage: a restarted container comes back after about this
        sidecar.start()
        served = [r.result(timeout=300) for r in replies]
    assert [len(ids) for ids in served] == [MAX_TOKENS] * REQUESTS
    assert server.metric("vllm:num_preemptions_total") == before
    log = server.log_text()
    assert OUTAGE_EFFECT in log  # what vLLM does while it is away, said once
    assert "answers again after" in log and "admitting again" in log
    assert "which kvbank admitted" not in log
    # The new sidecar's books: every request it re-registered or admitted was released.
    deadline = time.monotonic() + 10
    while (after := status(sidecar.address)).pool.outstanding or after.running:
        assert time.monotonic() < deadline, f"the new sidecar still holds reservations: {after}"
        time.sleep(0.1)
    assert not after.waiting
