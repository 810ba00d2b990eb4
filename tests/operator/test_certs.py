"""The webhook's certificates: issued, renewed on time, kept in one Secret under races, the CA
bundle patched into the webhook configuration, and a real TLS handshake on loopback that
trusts exactly that bundle."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from operator_fakes import FakeCluster

from kvbank.operator.certs import SERVING_LIFETIME, issue, service_names
from kvbank.operator.cluster import KubeConflict
from kvbank.operator.webhook_tls import (
    ServerTLS,
    TLSSettings,
    bundle_from_secret,
    ensure_certificate,
    patch_ca_bundle,
    refresh_tls,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TODAY = datetime.now(UTC)
NAMES = service_names("kvbank-webhook", "kvbank-system", ("127.0.0.1",))
SETTINGS = TLSSettings("self-signed", "kvbank-webhook-tls", "kvbank-system", NAMES, "kvbank")


def _vwc(*bundles: str) -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "kvbank"},
        "webhooks": [
            {"name": f"w{i}.kvbank.dev", "clientConfig": {"caBundle": b}}
            for i, b in enumerate(bundles)
        ],
    }


class TestIssue:
    def test_names_and_lifetimes(self) -> None:
        bundle = issue(None, NAMES, NOW)
        assert bundle is not None
        cert = x509.load_pem_x509_certificate(bundle.cert)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [
            "kvbank-webhook",
            "kvbank-webhook.kvbank-system",
            "kvbank-webhook.kvbank-system.svc",
            "kvbank-webhook.kvbank-system.svc.cluster.local",
        ]
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
        assert cert.not_valid_after_utc == NOW + SERVING_LIFETIME
        assert bundle.ca_bundle == bundle.ca_cert

    def test_kept_until_a_third_of_its_life_is_left(self) -> None:
        bundle = issue(None, NAMES, NOW)
        assert issue(bundle, NAMES, NOW + timedelta(days=240)) is None
        renewed = issue(bundle, NAMES, NOW + timedelta(days=250))
        assert renewed is not None and bundle is not None
        assert renewed.ca_cert == bundle.ca_cert and renewed.cert != bundle.cert

    def test_new_names_reissue_under_the_same_ca(self) -> None:
        bundle = issue(None, NAMES, NOW)
        other = issue(bundle, service_names("hook", "ops"), NOW)
        assert other is not None and bundle is not None and other.ca_cert == bundle.ca_cert

    def test_an_expiring_ca_is_replaced_and_bundled_with_the_old_one(self) -> None:
        bundle = issue(None, NAMES, NOW)
        assert bundle is not None
        later = NOW + timedelta(days=3650 - 365)
        renewed = issue(bundle, NAMES, later)
        assert renewed is not None and renewed.ca_cert != bundle.ca_cert
        assert renewed.ca_bundle == renewed.ca_cert + bundle.ca_cert


class TestSecret:
    def test_created_once_then_reused(self) -> None:
        cluster = FakeCluster()
        first = asyncio.run(ensure_certificate(cluster, SETTINGS, NOW))
        second = asyncio.run(ensure_certificate(cluster, SETTINGS, NOW))
        assert first == second
        secret = cluster.one("Secret", "kvbank-webhook-tls")
        assert bundle_from_secret(secret) == first
        assert [verb for verb, _ in cluster.calls] == ["get", "create", "get"]

    def test_losing_the_creation_race_uses_the_winners(self) -> None:
        cluster = FakeCluster()
        winner = asyncio.run(ensure_certificate(FakeCluster(), SETTINGS, NOW))
        original_get = cluster.get
        calls = {"n": 0}

        async def get_then_someone_creates(*args, **kwargs):
            calls["n"] += 1
            found = await original_get(*args, **kwargs)
            if calls["n"] == 1:  # another replica creates it right after our read
                from kvbank.operator.webhook_tls import secret_manifest

                cluster.put(secret_manifest(SETTINGS, winner))
            return found

        cluster.get = get_then_someone_creates  # type: ignore[method-assign]
        assert asyncio.run(ensure_certificate(cluster, SETTINGS, NOW)) == winner

    def test_renewal_replaces_with_the_version_read(self) -> None:
        cluster = FakeCluster()
        first = asyncio.run(ensure_certificate(cluster, SETTINGS, NOW))
        renewed = asyncio.run(ensure_certificate(cluster, SETTINGS, NOW + timedelta(days=300)))
        assert renewed.cert != first.cert
        assert bundle_from_secret(cluster.one("Secret", "kvbank-webhook-tls")) == renewed


class TestCaBundle:
    def test_patched_into_every_webhook_once(self) -> None:
        cluster = FakeCluster()
        cluster.put(_vwc("", "stale"))
        assert asyncio.run(patch_ca_bundle(cluster, "kvbank", b"CA"))
        encoded = base64.b64encode(b"CA").decode()
        hooks = cluster.one("ValidatingWebhookConfiguration", "kvbank")["webhooks"]
        assert [h["clientConfig"]["caBundle"] for h in hooks] == [encoded, encoded]
        assert not asyncio.run(patch_ca_bundle(cluster, "kvbank", b"CA"))

    def test_a_missing_configuration_is_not_an_error(self) -> None:
        assert asyncio.run(patch_ca_bundle(FakeCluster(), "kvbank", b"CA")) is None

    def test_a_configuration_that_appears_after_start_up_gets_the_ca(self, tmp_path: Path) -> None:
        # Helm creates the webhook configuration after the operator's Deployment: the first
        # refresh finds none and marks the CA pending, so the renewal loop looks again soon.
        cluster = FakeCluster()
        server = ServerTLS(tmp_path)
        asyncio.run(refresh_tls(cluster, SETTINGS, server, NOW))
        assert server.ca_pending
        cluster.put(_vwc(""))
        asyncio.run(refresh_tls(cluster, SETTINGS, server, NOW))
        assert not server.ca_pending
        hooks = cluster.one("ValidatingWebhookConfiguration", "kvbank")["webhooks"]
        assert all(h["clientConfig"]["caBundle"] for h in hooks)

    def test_a_configuration_that_keeps_changing_gives_up_loudly(self) -> None:
        cluster = FakeCluster()
        cluster.put(_vwc(""))

        async def always_conflict(manifest):
            raise KubeConflict(409, "changed")

        cluster.replace = always_conflict  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="kept changing"):
            asyncio.run(patch_ca_bundle(cluster, "kvbank", b"CA"))


def _handshake(server: ServerTLS, ca_bundle: bytes) -> str:
    """Serve one TLS handshake on loopback with the server's context; return the peer name."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        conn, _ = listener.accept()
        try:
            with server.context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    client = ssl.create_default_context(cadata=ca_bundle.decode())
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client.wrap_socket(raw, server_hostname="kvbank-webhook.kvbank-system.svc") as tls,
        ):
            subject = dict(x[0] for x in tls.getpeercert()["subject"])
            tls.sendall(b"x")
            return subject["commonName"]
    finally:
        thread.join(timeout=5)
        listener.close()


class TestServerTLS:
    def test_close_removes_the_key_it_wrote(self) -> None:
        server = ServerTLS()
        bundle = issue(None, NAMES, TODAY)
        assert bundle is not None
        server.load(bundle.cert, bundle.key)
        assert server.key_file.stat().st_mode & 0o077 == 0
        folder = server.key_file.parent
        server.close()
        assert not folder.exists()

    """Against the real clock: the client checks validity with it."""

    def test_serves_a_chain_the_bundle_verifies_and_reloads_in_place(self, tmp_path: Path) -> None:
        cluster = FakeCluster()
        cluster.put(_vwc(""))
        server = ServerTLS(tmp_path)
        issued = TODAY - timedelta(days=300)  # 65 days left: still valid, due for renewal
        assert asyncio.run(refresh_tls(cluster, SETTINGS, server, issued))
        hooks = cluster.one("ValidatingWebhookConfiguration", "kvbank")["webhooks"]
        bundle = base64.b64decode(hooks[0]["clientConfig"]["caBundle"])
        assert _handshake(server, bundle) == "kvbank-webhook"
        assert not asyncio.run(refresh_tls(cluster, SETTINGS, server, issued))
        old_cert = server.cert_file.read_bytes()
        assert asyncio.run(refresh_tls(cluster, SETTINGS, server, TODAY))
        assert server.cert_file.read_bytes() != old_cert
        assert _handshake(server, bundle) == "kvbank-webhook"  # same CA, new serving cert

    def test_cert_manager_mode_reads_the_mounted_files(self, tmp_path: Path) -> None:
        bundle = issue(None, NAMES, TODAY)
        assert bundle is not None
        (tmp_path / "tls.crt").write_bytes(bundle.cert)
        (tmp_path / "tls.key").write_bytes(bundle.key)
        settings = TLSSettings("cert-manager", "", "", NAMES, None, cert_dir=tmp_path)
        cluster = FakeCluster()
        server = ServerTLS(tmp_path / "served")
        (tmp_path / "served").mkdir()
        assert asyncio.run(refresh_tls(cluster, settings, server, TODAY))
        assert cluster.calls == []  # cert-manager owns the Secret and the bundle
        assert _handshake(server, bundle.ca_bundle) == "kvbank-webhook"
