"""The sidecar over TLS, as a real process: a client that trusts the right CA gets through, one
without TLS or trusting another CA fails with a message that says so; a listener other pods can
reach is refused at start-up unless it has a token and TLS (or the network is declared trusted)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.sidecar.backend import connect
from kvbank.sidecar.client import SidecarClient, SidecarError
from kvbank.sidecar.server import ConfigError, check_exposure, is_loopback

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret"


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class Ca:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def new(cls, name: str) -> Ca:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, dns: list[str], ips: list[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) of a server certificate for those names."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvbank-sidecar")]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass(frozen=True)
class TlsSidecar:
    address: str
    ca: Path


def _serve(tmp_path: Path, ca: Ca, dns: list[str], ips: list[str]) -> Iterator[TlsSidecar]:
    cert, key = ca.issue(dns, ips)
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.pem)):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "token").write_text(TOKEN + "\n")
    args = ["--metrics-port", "-1", "--token-file", str(tmp_path / "token")]
    args += ["--tls-cert-file", str(tmp_path / "tls.crt")]
    args += ["--tls-key-file", str(tmp_path / "tls.key")]
    proc, port, _ = spawn_sidecar(*args)
    try:
        yield TlsSidecar(f"127.0.0.1:{port}", tmp_path / "ca.crt")
    finally:
        stop_process(proc)


@pytest.fixture
def tls_sidecar(tmp_path: Path) -> Iterator[TlsSidecar]:
    yield from _serve(tmp_path, Ca.new("kvbank test CA"), ["localhost"], ["127.0.0.1"])


def kvbank(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_client_trusting_the_ca_gets_through(tls_sidecar: TlsSidecar) -> None:
    ca = tls_sidecar.ca.read_bytes()
    with SidecarClient(tls_sidecar.address, token=TOKEN, tls_ca=ca, retry_budget_s=0) as client:
        assert client.status().session == 0
    shown = kvbank(
        "status", tls_sidecar.address, "--ca-file", str(tls_sidecar.ca), "--token-file",
        str(tls_sidecar.ca.parent / "token"), "--json",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert '"session": 0' in shown.stdout  # a number, not the string "0"


def test_a_plaintext_client_fails_clearly(tls_sidecar: TlsSidecar) -> None:
    client = SidecarClient(tls_sidecar.address, token=TOKEN, retry_budget_s=0)
    with client, pytest.raises(SidecarError) as info:
        client.status()
    assert info.value.code == "UNAVAILABLE"
    with pytest.raises(ValueError, match="in plaintext: does it serve TLS"):
        connect(tls_sidecar.address, 1024, token=TOKEN, verify=True)
    token = str(tls_sidecar.ca.parent / "token")
    shown = kvbank("status", tls_sidecar.address, "--token-file", token)
    assert shown.returncode == 1
    assert "give --ca-file" in shown.stderr


def test_a_client_trusting_another_ca_fails_clearly(tls_sidecar: TlsSidecar) -> None:
    other = Ca.new("someone else's CA").pem
    client = SidecarClient(tls_sidecar.address, token=TOKEN, tls_ca=other, retry_budget_s=0)
    with client, pytest.raises(SidecarError) as info:
        client.status()
    assert info.value.code == "UNAVAILABLE"
    assert "CERTIFICATE_VERIFY_FAILED" in info.value.message or "handshake" in info.value.message
    with pytest.raises(ValueError, match="is its certificate signed by that CA"):
        connect(tls_sidecar.address, 1024, token=TOKEN, tls_ca=other, verify=True)


def test_the_server_name_can_differ_from_the_address(tmp_path: Path) -> None:
    """The operator's certificate names the pod's DNS names; a client dialling an IP says which
    name to check (`--sidecar-tls-server-name`)."""
    name = "pool-ranks-0.pool-ranks.team-a.svc"
    for sidecar in _serve(tmp_path, Ca.new("kvbank test CA"), [name], []):
        ca = sidecar.ca.read_bytes()
        unnamed = SidecarClient(sidecar.address, TOKEN, ca, retry_budget_s=0)
        with unnamed, pytest.raises(SidecarError):
            unnamed.status()  # 127.0.0.1 is not a name the certificate carries
        with SidecarClient(sidecar.address, TOKEN, ca, name, retry_budget_s=0) as client:
            assert client.status().session == 0


def test_a_non_loopback_listener_with_a_token_needs_tls(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    refused = kvbank(
        "sidecar", "--listen", "0.0.0.0:0", "--token-file", str(token), "--metrics-port", "-1"
    )
    assert refused.returncode == 2
    assert "give --tls-cert-file and --tls-key-file, or --trusted-network" in refused.stderr
    assert "serving" not in refused.stdout


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.0.0.2:50051", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("0.0.0.0:50051", False),
        ("10.1.2.3:50051", False),
        ("pool-ranks-0.pool-ranks:50051", False),
    ],
)
def test_which_listeners_are_loopback(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback


def test_the_exposure_rules() -> None:
    check_exposure("127.0.0.2:1", token=False, tls=False, trusted_network=False)
    check_exposure("10.1.2.3:1", token=True, tls=True, trusted_network=False)
    check_exposure("10.1.2.3:1", token=True, tls=False, trusted_network=True)
    with pytest.raises(ConfigError, match="--trusted-network"):
        check_exposure("10.1.2.3:1", token=True, tls=False, trusted_network=False)
    with pytest.raises(ConfigError, match="give --token-file"):
        check_exposure("10.1.2.3:1", token=False, tls=True, trusted_network=True)
