"""A rank pod's sidecar as the operator renders it, with a certificate the operator issued, run
for real on loopback: `kvbank sidecar` takes the rendered TLS flags and the projected Secret's
files, and both `kvbank status` and the operator's own status reader get through with the
pool's CA, checking the names the certificate carries (localhost, the one the engine checks on
its Unix socket; a pod's DNS name, the operator's)."""

from __future__ import annotations

import asyncio
import base64
import shutil
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from operator_fakes import FakeCluster
from operator_specs import pool_doc

from kvbank.capacity import holdability
from kvbank.modelpool import parse_modelpool
from kvbank.operator.certs import CertBundle, new_ca
from kvbank.operator.live import SidecarClientSource
from kvbank.operator.pool_tls import ensure_pool_tls
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.engines import SIDECAR_SOCKET
from kvbank.operator.render.names import Owner, RenderSettings, Workload

TOKEN = "t0ken-for-tls-tests"
SETTINGS = RenderSettings(sidecar_token=TOKEN)
OWNER = Owner("llama", "team-a", "uid-7")
KVBANK = shutil.which("kvbank", path=str(Path(sys.executable).parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvbank(*args: str) -> list[str]:
    return [KVBANK, *args] if KVBANK else [sys.executable, "-m", "kvbank.cli", *args]


def _rendered_pod(tmp_path: Path) -> tuple[list[str], list[str], bytes]:
    """The engine's and the sidecar's args with every mounted path moved under tmp_path, and
    the CA bundle."""
    now = datetime.now(UTC)
    ca_cert, ca_key = new_ca(now)
    issuer = CertBundle(ca_cert, ca_key, b"", b"", ca_cert)
    cluster = FakeCluster()
    tls, _ = asyncio.run(ensure_pool_tls(cluster, OWNER, {}, issuer, now))
    assert tls is not None
    secret = cluster.one("Secret", "llama-sidecar-tls")
    pool, doc = parse_modelpool(pool_doc()), pool_doc()
    rendered = render_pool(
        pool, holdability(pool), OWNER, doc["spec"], SETTINGS, Workload.STATEFUL_SET, None, tls
    )
    files = {
        "/etc/kvbank/sidecar-tls": {k: base64.b64decode(v) for k, v in secret["data"].items()},
        "/etc/kvbank/config": {k: v.encode() for k, v in rendered.manifests[0]["data"].items()},
        "/var/run/kvbank/sidecar-token": {"token": TOKEN.encode()},
    }
    for mount, contents in files.items():
        folder = tmp_path / mount.strip("/").replace("/", "_")
        folder.mkdir()
        for name, data in contents.items():
            (folder / name).write_bytes(data)
    engine, sidecar = rendered.manifests[-1]["spec"]["template"]["spec"]["containers"]
    (tmp_path / "socket").mkdir()

    def local(args: list[str]) -> list[str]:
        out = []
        for arg in args:
            for mount in files:
                if arg.startswith(mount + "/"):
                    arg = str(tmp_path / mount.strip("/").replace("/", "_")) + arg[len(mount) :]
            out.append(f"unix://{tmp_path}/socket/admission.sock" if arg == SIDECAR_SOCKET else arg)
        return out

    return local(engine["args"]), local(sidecar["args"]), files["/etc/kvbank/sidecar-tls"]["ca.crt"]


def test_the_rendered_sidecar_serves_tls_its_clients_verify(tmp_path: Path) -> None:
    engine, args, ca = _rendered_pod(tmp_path)
    assert "--tls-cert-file" in args and "--trusted-network" not in args
    port, metrics = _free_port(), _free_port()
    # Loopback only here: the rendered 0.0.0.0 is the pod's address.
    args[args.index("--listen") + 1] = f"127.0.0.1:{port}"
    args[args.index("--metrics-port") + 1] = str(metrics)
    args[args.index("--metrics-host") + 1] = "127.0.0.1"
    (tmp_path / "ca.crt").write_bytes(ca)
    token_file = tmp_path / "var_run_kvbank_sidecar-token" / "token"
    sidecar = subprocess.Popen(
        _kvbank(*args[1:]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        status = [
            "status", f"127.0.0.1:{port}", "--token-file", str(token_file),
            "--ca-file", str(tmp_path / "ca.crt"),
        ]  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(_kvbank(*status), capture_output=True, text=True, timeout=30)
            if out.returncode == 0 or time.monotonic() > deadline or sidecar.poll() is not None:
                break
            time.sleep(0.5)
        assert out.returncode == 0, (out.stderr, sidecar.poll())
        # The engine's way in: its --sidecar socket, over TLS with its CA and the name it checks.
        socket_status = [
            "status", engine[engine.index("--sidecar") + 1], "--token-file", str(token_file),
            "--ca-file", engine[engine.index("--sidecar-ca-file") + 1],
            "--tls-server-name", engine[engine.index("--sidecar-tls-server-name") + 1],
        ]  # fmt: skip
        assert socket_status[1].startswith(f"unix://{tmp_path}/")
        out = subprocess.run(_kvbank(*socket_status), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        # The operator's reader: the pod's IP dialled, its DNS name checked.
        source = SidecarClientSource(TOKEN)
        source.ca_bundle = ca
        figures = asyncio.run(
            source.status(f"127.0.0.1:{port}", 5.0, "llama-0.llama-ranks.team-a.svc")
        )
        assert figures.pages_total == 20000
        # A name the certificate does not carry is refused.
        wrong = subprocess.run(
            _kvbank(*status, "--tls-server-name", "elsewhere.example"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert wrong.returncode == 1
    finally:
        sidecar.terminate()
        try:
            sidecar.wait(timeout=15)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait(timeout=10)
