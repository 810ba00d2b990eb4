"""`kvbank sidecar` and `kvbank status` as processes: the pool from a manifest, Prometheus
metrics, TLS with a token, graceful SIGTERM, and refusing an open listen address."""

from __future__ import annotations

import datetime
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(60)
MANIFEST = ROOT / "examples" / "modelpool-llama-8b.yaml"


def kvbank(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_pool_metrics_status_and_graceful_sigterm() -> None:
    proc, port, metrics_port = spawn_sidecar(
        "--pool", str(MANIFEST), "--metrics-port", "0", "--policy", "banker"
    )
    address = f"127.0.0.1:{port}"
    try:
        with SidecarClient(address) as client:
            session = client.open_session(
                pb.OpenSessionRequest(engine_id="e", total_pages=20000)
            ).session
            client.report(
                pb.ReportRequest(
                    session=session,
                    report_seq=1,
                    applied_seq=-1,
                    events=[
                        pb.Event(submit=pb.Submit(rid="a", pages=513)),
                        pb.Event(submit=pb.Submit(rid="b", pages=30000)),
                        pb.Event(submit=pb.Submit(rid="c", pages=19999)),
                    ],
                    admit=True,
                )
            )
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        text = scrape.read().decode()
        for line in (
            "kvbank_pages_total 20000.0",
            "kvbank_pages_free 19999.0",
            "kvbank_pages_reserved 513.0",
            "kvbank_pages_outstanding 513.0",
            "kvbank_queue_depth 1.0",
            "kvbank_waits_total 1.0",
            "kvbank_admissions_total 1.0",
            "kvbank_rejections_total 1.0",
            "kvbank_admission_wait_seconds_count 1.0",
            "kvbank_decision_latency_seconds_count 1.0",
        ):
            assert line in text.splitlines(), line
        shown = kvbank("status", address)
        assert shown.returncode == 0, shown.stderr
        assert "20000 pages (19999 usable): free 19999, evictable 0" in shown.stdout
        assert "reserved 513, held 0, outstanding 513 (slack 19486)" in shown.stdout
        assert f"  {'c':<24} {19999:>8} pages" in shown.stdout.splitlines()
        row = f"  {'a':<24} seq {1:>6}  reserved {513:>6}  held {0:>6}"
        assert row in shown.stdout.splitlines()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        assert proc.stdout is not None and "kvbank sidecar: stopped" in proc.stdout.read()
        stop_process(proc)


def test_status_of_an_unreachable_sidecar_fails_with_the_reason() -> None:
    shown = kvbank("status", "127.0.0.1:1", "--deadline-s", "0.5")
    assert shown.returncode == 1
    assert "error: sidecar 127.0.0.1:1: UNAVAILABLE" in shown.stderr


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvbank-sidecar")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_and_token_for_followers_in_other_pods(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = ["--metrics-port", "-1", "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    proc, port, _ = spawn_sidecar(*args, "--token-file", str(token), "--pool", str(MANIFEST))
    address = f"localhost:{port}"
    try:
        with SidecarClient(address, token="s3cret", tls_ca=cert.read_bytes()) as client:
            assert client.status().usable_pages == 19999
        shown = kvbank("status", address, "--ca-file", str(cert), "--token-file", str(token))
        assert shown.returncode == 0, shown.stderr
        denied = kvbank("status", address, "--ca-file", str(cert))
        assert denied.returncode == 1
        assert "UNAUTHENTICATED" in denied.stderr
    finally:
        stop_process(proc)


def test_an_open_listen_address_needs_a_token() -> None:
    refused = kvbank("sidecar", "--listen", "0.0.0.0:0", "--metrics-port", "-1")
    assert refused.returncode == 2
    assert "not a loopback address: give --token-file" in refused.stderr
    bad_pool = kvbank("sidecar", "--pool", str(ROOT / "missing.yaml"), "--metrics-port", "-1")
    assert bad_pool.returncode == 2
    assert "missing.yaml" in bad_pool.stderr
