"""Faults with real processes on loopback: the sidecar SIGKILLed mid-run and restarted, and an
engine that dies holding reservations."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engine_run import run, scenario
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.ledger.client import embedded
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(120)


def test_a_sidecar_killed_mid_run_and_restarted_loses_nothing_and_counts_nothing_twice() -> None:
    sc = scenario("shared-prefix", 24, 16)
    local = run(sc, embedded(sc.pages, debug=True))
    first, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug")
    address = f"127.0.0.1:{port}"
    processes = [first]
    client = SidecarClient(address, retry_budget_s=20)
    backend = SidecarBackend(client, sc.pages, blocking=True)
    seen: dict[str, int] = {}

    def restart() -> None:
        processes.append(spawn_sidecar("--listen", address, "--metrics-port", "-1", "--debug")[0])

    def kill_mid_run(step: int) -> None:
        if step != 400:
            return
        status = client.status()
        seen.update(running=status.running, waiting=status.waiting)
        first.send_signal(signal.SIGKILL)
        first.wait(5)
        # Back after half a second: the engine's next report rides out UNAVAILABLE meanwhile.
        threading.Timer(0.5, restart).start()

    try:
        remote = run(sc, backend, on_step=kill_mid_run)  # checks integrity after every step
        status = client.status()
    finally:
        client.close()
        for proc in processes:
            stop_process(proc)
    assert seen["running"] > 0 and seen["waiting"] > 0  # killed with work in both states
    assert backend.sessions_opened == 2
    assert remote.completions == local.completions  # none lost
    assert remote.admitted == local.admitted  # each admitted once, in the same order
    assert (status.running, status.waiting, status.outstanding, status.reserved) == (0, 0, 0, 0)


def test_a_sidecar_killed_under_a_non_blocking_peak_fit_engine_loses_nothing() -> None:
    """The served path: the engine never waits, decisions in flight die with the sidecar, and
    admissions decided but not yet started are restored at their worst case; a late Start for
    one of them is taken as what it is."""
    policy = "peak+backfill"
    sc = scenario("shared-prefix", 24, 16)
    local = run(sc, embedded(sc.pages, debug=True), policy=policy)
    first, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug", "--policy", policy)
    address = f"127.0.0.1:{port}"
    processes = [first]
    client = SidecarClient(address, retry_budget_s=20)
    backend = SidecarBackend(client, sc.pages, blocking=False)
    seen: dict[str, int] = {}

    def restart() -> None:
        again = spawn_sidecar("--listen", address, "--metrics-port", "-1", "--debug", "--policy",
                              policy)  # fmt: skip
        processes.append(again[0])

    def kill_mid_run(step: int) -> None:
        time.sleep(0.0005)  # a forward pass: replies arrive within steps, as when serving
        if seen or step < 300:
            return
        status = client.status()
        if not (status.running and status.waiting):
            return
        seen.update(running=status.running, waiting=status.waiting)
        first.send_signal(signal.SIGKILL)
        first.wait(5)
        threading.Timer(0.5, restart).start()

    try:
        remote = run(sc, backend, on_step=kill_mid_run, policy=policy)
        backend.flush()
        status = client.status()
    finally:
        client.close()
        for proc in processes:
            stop_process(proc)
    assert seen["running"] > 0 and seen["waiting"] > 0  # killed with work in both states
    assert backend.sessions_opened == 2
    assert remote.completions == local.completions  # none lost
    assert sorted(remote.admitted) == sorted(local.completions)  # each admitted once
    assert (status.running, status.waiting, status.outstanding, status.reserved) == (0, 0, 0, 0)


def test_a_dead_engines_reservations_are_dropped_and_a_new_session_starts_clean(
    tmp_path: Path,
) -> None:
    sidecar, port, _ = spawn_sidecar("--metrics-port", "-1")
    address = f"127.0.0.1:{port}"
    engine = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("engine_proc.py")), address, "0.5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "running", engine.stderr.read()
        with SidecarClient(address) as client:
            before = client.status()
            assert before.running > 0 and before.reserved > 0
            engine.send_signal(signal.SIGKILL)
            engine.wait(5)
            deadline = time.monotonic() + 5
            while client.status().session != 0:
                assert time.monotonic() < deadline, "the dead engine's session was not dropped"
                time.sleep(0.05)
            after = client.status()
            assert (after.running, after.waiting, after.reserved, after.outstanding) == (
                0,
                0,
                0,
                0,
            )
            sc = scenario("shared-prefix", 8, 8)
            fresh = SidecarBackend(client, sc.pages, engine_id="fresh")
            record = run(sc, fresh)
            assert len(record.completions) == 8
            assert fresh.sessions_opened == 1
            assert client.status().session not in (0, before.session)
    finally:
        stop_process(engine)
        stop_process(sidecar)
