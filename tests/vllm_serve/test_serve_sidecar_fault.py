"""`vllm serve` with kvbank's scheduler class over a `kvbank sidecar` on a Unix socket, as the
operator's pods run it, when the sidecar dies (SIGKILL) under load and comes back on the same
socket, as the kubelet restarts it, or hangs (SIGSTOP) and resumes: nothing is lost. Running
requests keep their pages and finish, waiting ones wait for the sidecar, whose new session
re-registers what still runs, and every request gets all its tokens with no preemption. A
module of its own: it kills its sidecar."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
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
# 5 blocks each at their end, 3 at a time on 15: three rounds, two of which the sidecar
# admits only after the fault (whatever the machine's speed: a round is 600 steps).
REQUESTS, MAX_TOKENS = 9, 600


class Sidecar:
    """The sidecar process on one Unix socket, killed and started again on it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc, _, _ = spawn_sidecar("--listen", self.address, "--metrics-port", "-1", "--debug")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

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


def one(server: VllmServer, i: int) -> list[int]:
    reply = server.client.completions.create(
        model=MODEL_NAME,
        prompt=f"{i} the page cache {i}",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(getattr(reply.choices[0], "token_ids", None) or [])


def under_load(server: VllmServer, sidecar: Sidecar, fault: Callable[[], None]) -> str:
    """REQUESTS completions, `fault` done to the sidecar once its ledger runs the first of
    them; checks every request got all its tokens with no preemption and the sidecar's books
    end empty, and returns the server's log."""
    before = server.metric("vllm:num_preemptions_total")
    with ThreadPoolExecutor(REQUESTS) as pool:
        replies = [pool.submit(one, server, i) for i in range(REQUESTS)]
        deadline = time.monotonic() + 60
        while not (now := status(sidecar.address)).running:
            assert time.monotonic() < deadline, f"the sidecar never admitted a request: {now}"
            time.sleep(0.02)
        assert not all(r.done() for r in replies), "the load ended before the fault"
        fault()
        served = [r.result(timeout=300) for r in replies]
    assert [len(ids) for ids in served] == [MAX_TOKENS] * REQUESTS
    assert server.metric("vllm:num_preemptions_total") == before
    log = server.log_text()
    assert "which kvbank admitted" not in log
    # The sidecar's books: every request it re-registered or admitted was released, well
    # within its 10 s lease (which would drop them too): the idle engine sent its last report.
    # Not 3 s: a machine that stalls 2 s can end a session then, and the next opens after a
    # backoff of up to 2 s (sidecar/backend_wire.py), re-registering nothing.
    deadline = time.monotonic() + 6
    while (after := status(sidecar.address)).pool.outstanding or after.running:
        assert time.monotonic() < deadline, f"the sidecar still holds reservations: {after}"
        time.sleep(0.1)
    assert not after.waiting
    return log


def test_a_sidecar_killed_under_load_and_restarted_loses_no_request(
    server: VllmServer, sidecar: Sidecar
) -> None:
    def restart() -> None:
        sidecar.kill()
        time.sleep(1.0)  # the outage: a restarted container comes back after about this
        sidecar.start()

    log = under_load(server, sidecar, restart)
    assert OUTAGE_EFFECT in log  # what vLLM does while it is away, said once
    # Once at least: on a machine that stalls for seconds a report can also go unanswered
    # past its deadline, which ends the session the same way.
    assert log.count("answers again after") >= 1 and "admitting again" in log


def test_a_sidecar_hung_under_load_then_resumed_loses_no_request(
    server: VllmServer, sidecar: Sidecar
) -> None:
    def hang() -> None:
        sidecar.signal(signal.SIGSTOP)  # the socket stays up and nothing answers
        time.sleep(3.0)  # past a call's 2 s deadline (kvbank.sidecar.client): the session ends
        sidecar.signal(signal.SIGCONT)

    before = server.log_text().count("answers again after")
    log = under_load(server, sidecar, hang)
    assert log.count("answers again after") >= before + 1  # after its session was ended
