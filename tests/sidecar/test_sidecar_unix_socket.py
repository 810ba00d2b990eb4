"""`kvbank sidecar --listen unix:///PATH`: the sidecar on a Unix socket, as the engine in the same
pod reaches it over a shared volume (beside the pod address the operator reads), and the listen
addresses it refuses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_harness import ROOT, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient

SCENARIO = Path(__file__).resolve().with_name("scenarios") / "shared-prefix.yaml"
SIDECAR = [sys.executable, "-m", "kvbank.cli", "sidecar", "--metrics-port", "-1"]


def _start(*listen: str) -> tuple[subprocess.Popen[str], str]:
    """The sidecar serving on every `listen` address, and where its first line says it serves."""
    argv = [arg for address in listen for arg in ("--listen", address)]
    proc = subprocess.Popen(
        [*SIDECAR, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    served = re.match(r"kvbank sidecar: serving on (.+), metrics ", line)
    assert served, line
    return proc, served.group(1)


def _spawn(listen: str) -> subprocess.Popen[str]:
    proc, where = _start(listen)
    assert where == listen
    return proc


def test_a_bench_over_a_unix_socket_prints_the_embedded_json(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/admission.sock"
    bench = [
        sys.executable,
        "-m",
        "kvbank.cli",
        "bench",
        "--scenario",
        str(SCENARIO),
        "--policy",
        "peak+backfill",
        "--json",
    ]
    proc = _spawn(address)
    try:
        local = subprocess.run(bench, capture_output=True, text=True, timeout=120, cwd=ROOT)
        remote = subprocess.run(
            [*bench, "--sidecar", address], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        with SidecarClient(address) as client:
            served = client.status_reply()
    finally:
        stop_process(proc)
    assert local.returncode == remote.returncode == 0, remote.stderr[-2000:]
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    assert not served.running and served.next_seq > 0  # nothing left reserved


def test_a_pod_address_and_a_socket_serve_one_ledger(tmp_path: Path) -> None:
    """As a rank pod's sidecar runs: the session its engine opens on the socket is the one the
    operator's status read sees on the TCP port."""
    socket = f"unix://{tmp_path}/admission.sock"
    proc, where = _start("127.0.0.1:0", socket)
    try:
        tcp, _, unix = where.partition(" and ")
        assert unix == socket and re.fullmatch(r"127\.0\.0\.1:\d+", tcp), where
        with SidecarClient(socket) as engine:
            opened = engine.open_session(pb.OpenSessionRequest(total_pages=64))
        with SidecarClient(tcp) as operator:
            status = operator.status()
    finally:
        stop_process(proc)
    assert (status.session, status.total_pages) == (opened.session, 64)


def test_a_socket_a_killed_sidecar_left_is_taken_over(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/admission.sock"
    first = _spawn(address)
    first.kill()
    first.wait(10)
    assert (tmp_path / "admission.sock").is_socket()
    second = _spawn(address)
    try:
        with SidecarClient(address) as client:
            assert client.status_reply().next_seq == 0
    finally:
        stop_process(second)


@pytest.mark.parametrize(
    ("listen", "says"),
    [
        ("unix:///no/such/folder/admission.sock", "the folder /no/such/folder does not exist"),
        ("unix:///tmp/", "give the socket's file, unix:///PATH"),
        (f"unix:///tmp/{'x' * 120}.sock", "a Unix socket's path is at most 107"),
    ],
)
def test_a_listen_address_no_socket_can_take_is_refused(listen: str, says: str) -> None:
    done = subprocess.run(
        [*SIDECAR, "--listen", listen], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr


def test_a_file_that_is_not_a_socket_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("kept")
    done = subprocess.run(
        [*SIDECAR, "--listen", f"unix://{path}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "exists and is not a socket" in done.stderr
    assert path.read_text() == "kept"
