"""A pod whose sidecar is killed leaves the picks within one second, and the picker says so in
its log (and in `kvbank_picker_pod_losses_total`)."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from picker_harness import Pod, ThreadPicker
from sidecar_harness import spawn_sidecar
from test_picker_protocol import PROMPT, answers, destination

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient


class ProcessPod(Pod):
    """A `kvbank sidecar` process (so it can be SIGKILLed) with its engine session open."""

    def __init__(self) -> None:
        self.proc, port, _ = spawn_sidecar("--metrics-port", "-1")
        self.endpoint = "10.0.0.0:8000"
        self.address = f"127.0.0.1:{port}"
        self.client = SidecarClient(self.address)
        self.client.open_session(pb.OpenSessionRequest(
            engine_id="e", total_pages=101, lease_ms=600_000,
            supply=pb.Supply(free=100, evictable=0)))  # fmt: skip

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_a_killed_sidecar_leaves_the_picks_within_one_second(
    pool_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    victim, other = ProcessPod(), Pod(1)
    victim.sidecar = type("S", (), {"address": victim.address})()  # what ThreadPicker reads
    picker = ThreadPicker([victim, other], pool_file).start_and_wait()
    caplog.set_level(logging.INFO, logger="kvbank.picker")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            extproc = ep_grpc.ExternalProcessorStub(channel)
            deadline = time.monotonic() + 5
            while destination(answers(extproc, PROMPT))[0] != victim.endpoint:  # packs by name
                assert time.monotonic() < deadline, "the victim was never picked"
            victim.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            while destination(answers(extproc, PROMPT))[0] == victim.endpoint:
                assert time.monotonic() - killed < 1.0, "still picked 1 s after its sidecar died"
            left = time.monotonic() - killed
            for _ in range(5):
                assert destination(answers(extproc, PROMPT))[0] == other.endpoint
    finally:
        picker.shutdown()
        victim.stop()
        other.stop()
    assert left < 1.0
    assert any("lost the sidecar of pod 10.0.0.0:8000" in r.getMessage() for r in caplog.records)


def chosen(extproc: ep_grpc.ExternalProcessorStub) -> str | None:
    """The endpoint picked, or None when the picker answered otherwise (a 503 on a loaded box
    whose other pod's heartbeat was late)."""
    replies = answers(extproc, PROMPT)
    if replies[-1].WhichOneof("response") == "immediate_response":
        return None
    return destination(replies)[0]


def test_a_hung_sidecar_leaves_the_picks_within_one_second(
    pool_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP: the connection stays up and nothing arrives; the heartbeat's absence is the
    signal (`--loss-after-s 0.75`, heartbeats every 0.25 s)."""
    victim, other = ProcessPod(), Pod(1)
    victim.sidecar = type("S", (), {"address": victim.address})()
    picker = ThreadPicker([victim, other], pool_file, "--loss-after-s", "0.75").start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            extproc = ep_grpc.ExternalProcessorStub(channel)
            deadline = time.monotonic() + 5
            while chosen(extproc) != victim.endpoint:
                assert time.monotonic() < deadline, "the victim was never picked"
            caplog.set_level(logging.INFO, logger="kvbank.picker")
            victim.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            # No pick is sent its way meanwhile (a hold there would time out and say so too):
            # the loss must come from the missing heartbeat alone.
            lost = f"lost the sidecar of pod {victim.endpoint}"
            while not any(lost in r.getMessage() for r in caplog.records):
                assert time.monotonic() - stopped < 1.0, "a hung sidecar's pod stayed 1 s"
                time.sleep(0.01)
            assert any("no figures for 0.75 s" in r.getMessage() for r in caplog.records)
            assert chosen(extproc) in (other.endpoint, None)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        picker.shutdown()
        victim.stop()
        other.stop()
