"""Follower ranks as real processes against a real sidecar process: lag, disconnect and resume,
a decision a rank cannot apply, and a dead follower that must not hold rank 0 back."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(60)
FOLLOWER = Path(__file__).with_name("follower_proc.py")


class RankZero:
    """Rank 0's engine session, reduced to what the stream needs: each report admits a batch."""

    def __init__(self, address: str) -> None:
        self.client = SidecarClient(address, retry_budget_s=5)
        self.session = self.client.open_session(
            pb.OpenSessionRequest(engine_id="rank-0", total_pages=1001)
        ).session
        self.report_seq = 0
        self.decided: list[tuple[int, str]] = []

    def admit(self, rids: list[str]) -> float:
        """Submit, admit and release `rids` in one report; returns the call's seconds."""
        self.report_seq += 1
        events = [pb.Event(submit=pb.Submit(rid=rid, pages=1)) for rid in rids]
        started = time.perf_counter()
        reply = self.client.report(
            pb.ReportRequest(
                session=self.session,
                report_seq=self.report_seq,
                applied_seq=self.decided[-1][0] if self.decided else -1,
                events=events,
                admit=True,
            )
        )
        elapsed = time.perf_counter() - started
        self.decided += [(d.seq, d.rid) for d in reply.decisions]
        self.report_seq += 1
        self.client.report(
            pb.ReportRequest(
                session=self.session,
                report_seq=self.report_seq,
                applied_seq=self.decided[-1][0],
                events=[pb.Event(release=pb.Release(rid=rid)) for rid in rids],
            )
        )
        return elapsed


def start_follower(address: str, record: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(FOLLOWER), address, str(record), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def recorded(record: Path) -> list[tuple[int, str]]:
    lines = record.read_text().splitlines() if record.exists() else []
    return [(int(seq), rid) for seq, rid, _ in (line.split() for line in lines)]


def wait_until(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_lagging_follower_killed_mid_stream_resumes_from_its_sequence_number(
    tmp_path: Path,
) -> None:
    sidecar, port, _ = spawn_sidecar("--metrics-port", "-1")
    address = f"127.0.0.1:{port}"
    record = tmp_path / "rank1.txt"
    try:
        rank0 = RankZero(address)
        for batch in range(8):
            rank0.admit([f"r{batch}-{i}" for i in range(5)])
        slow = start_follower(address, record, "--apply-s", "0.02")
        wait_until(lambda: len(recorded(record)) >= 12)
        slow.send_signal(signal.SIGKILL)  # disconnects mid-stream, behind rank 0
        slow.wait(5)
        stop_process(slow)
        applied = recorded(record)
        assert applied == rank0.decided[: len(applied)]
        for batch in range(8, 12):  # rank 0 goes on while the follower is away
            rank0.admit([f"r{batch}-{i}" for i in range(5)])
        resumed = start_follower(
            address, record, "--from-seq", str(applied[-1][0] + 1), "--until-seq", "59"
        )
        assert resumed.wait(20) == 0, resumed.stderr.read() if resumed.stderr else ""
        stop_process(resumed)
        assert recorded(record) == rank0.decided  # every decision once, in order
        status = rank0.client.status_reply()
        assert [(f.follower_id, f.acked_seq) for f in status.followers] == [("rank-1", 59)]
        assert status.log_length == 0  # everything acknowledged is dropped
    finally:
        stop_process(sidecar)


def test_a_follower_that_cannot_apply_a_decision_exits_non_zero_with_the_reason(
    tmp_path: Path,
) -> None:
    sidecar, port, _ = spawn_sidecar("--metrics-port", "-1")
    address = f"127.0.0.1:{port}"
    try:
        rank0 = RankZero(address)
        rank0.admit(["a", "b", "c", "d"])
        follower = start_follower(address, tmp_path / "rank1.txt", "--poison", "c")
        code = follower.wait(20)
        err = follower.stderr.read() if follower.stderr else ""
        stop_process(follower)
        assert code == 3
        assert "cannot apply decision 2 (Admitted 'c')" in err
        assert "this rank's pool cannot hold 'c'" in err
        assert recorded(tmp_path / "rank1.txt") == [(0, "a"), (1, "b")]
    finally:
        stop_process(sidecar)


def test_rank_zero_never_waits_on_a_dead_follower_and_the_log_stays_bounded(
    tmp_path: Path,
) -> None:
    sidecar, port, _ = spawn_sidecar(
        "--metrics-port", "-1", "--follower-timeout-s", "0.5", "--log-max", "16"
    )
    address = f"127.0.0.1:{port}"
    record = tmp_path / "rank1.txt"
    try:
        rank0 = RankZero(address)
        rank0.admit([f"a{i}" for i in range(4)])
        follower = start_follower(address, record)
        wait_until(lambda: [f.acked_seq for f in rank0.client.status_reply().followers] == [3])
        follower.send_signal(signal.SIGKILL)
        follower.wait(5)
        stop_process(follower)
        slowest = max(rank0.admit([f"b{n}-{i}" for i in range(5)]) for n in range(10))
        assert slowest < 1.0  # never blocked on the dead rank
        wait_until(lambda: not rank0.client.status_reply().followers, timeout=5)
        status = rank0.client.status_reply()
        assert status.log_length == 16  # bounded: the dead rank no longer holds it
        assert status.log_first_seq == status.next_seq - 16
        late = start_follower(address, tmp_path / "late.txt", "--from-seq", "4")
        assert late.wait(20) == 3
        assert "the log holds decisions 38..53" in (late.stderr.read() if late.stderr else "")
        stop_process(late)
    finally:
        stop_process(sidecar)
