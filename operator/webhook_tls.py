"""The webhook server's TLS, in one of two modes.

- `self-signed`: the operator keeps a CA and a serving certificate in a Secret, renews them
  (`certs.issue`), and patches the CA bundle into the chart's ValidatingWebhookConfiguration.
  Several operator replicas converge: creating the Secret is first-wins (409 -> read theirs),
  replacing it and the configuration are compare-and-swap (409 -> re-read, retry).
- `cert-manager`: cert-manager writes the Secret, the kubelet mounts it at `cert_dir`, and
  cert-manager's CA injector fills the bundle; the operator only reloads changed files.

The server's `ssl.SSLContext` is loaded again in place on renewal: new handshakes use the new
certificate and the operator never restarts for it.
"""

from __future__ import annotations

import base64
import logging
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvbank.operator.certs import CertBundle, issue
from kvbank.operator.cluster import Cluster, KubeConflict

log = logging.getLogger(__name__)
VWC = ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration")
KEYS = {"ca.crt": "ca_cert", "ca.key": "ca_key", "tls.crt": "cert", "tls.key": "key"}
BUNDLE_KEY = "ca-bundle.crt"
ATTEMPTS = 5
# While the webhook configuration is missing, how often it is looked for again: until its CA
# bundle is in, the API server refuses every ModelPool write the webhook is called for.
CA_RETRY_S = 2.0


@dataclass(frozen=True)
class TLSSettings:
    mode: str  # "self-signed" | "cert-manager"
    secret_name: str
    namespace: str
    names: tuple[str, ...]
    webhook_configuration: str | None
    cert_dir: Path | None = None  # cert-manager mode: where tls.crt and tls.key are mounted


def bundle_from_secret(secret: dict[str, Any] | None) -> CertBundle | None:
    data = (secret or {}).get("data") or {}
    if not all(k in data for k in KEYS):
        return None
    try:
        fields = {attr: base64.b64decode(data[key]) for key, attr in KEYS.items()}
        bundle = base64.b64decode(data.get(BUNDLE_KEY) or data["ca.crt"])
    except (ValueError, TypeError):
        return None
    return CertBundle(ca_bundle=bundle, **fields)


def secret_manifest(settings: TLSSettings, bundle: CertBundle) -> dict[str, Any]:
    data = {key: base64.b64encode(getattr(bundle, attr)).decode() for key, attr in KEYS.items()}
    data[BUNDLE_KEY] = base64.b64encode(bundle.ca_bundle).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": settings.secret_name,
            "namespace": settings.namespace,
            "labels": {"app.kubernetes.io/managed-by": "kvbank-operator"},
        },
        "data": data,
    }


async def ensure_certificate(cluster: Cluster, settings: TLSSettings, now: datetime) -> CertBundle:
    for _ in range(ATTEMPTS):
        secret = await cluster.get("v1", "Secret", settings.secret_name, settings.namespace)
        existing = bundle_from_secret(secret)
        fresh = issue(existing, settings.names, now)
        if fresh is None and existing is not None:
            return existing
        assert fresh is not None
        manifest = secret_manifest(settings, fresh)
        if secret is None:
            if await cluster.create(manifest) is not None:
                return fresh
            continue  # another replica created it first: use theirs
        manifest["metadata"]["resourceVersion"] = secret["metadata"].get("resourceVersion")
        try:
            await cluster.replace(manifest)
            return fresh
        except KubeConflict:
            continue
    raise RuntimeError(
        f"Secret {settings.namespace}/{settings.secret_name} kept changing under "
        f"{ATTEMPTS} attempts to renew it; is another operator fighting over it?"
    )


async def patch_ca_bundle(cluster: Cluster, name: str, ca_bundle: bytes) -> bool | None:
    """Put the CA bundle into every webhook of the configuration; True when it changed, None
    when the configuration does not exist (yet: Helm creates it after the operator's
    Deployment, so a starting operator may look before it is there)."""
    encoded = base64.b64encode(ca_bundle).decode()
    for _ in range(ATTEMPTS):
        config = await cluster.get(*VWC, name)
        if config is None:
            log.warning(
                "ValidatingWebhookConfiguration %s not found; its CA bundle is patched once it "
                "appears (checked every %g s)",
                name,
                CA_RETRY_S,
            )
            return None
        webhooks = config.get("webhooks") or []
        if all((w.get("clientConfig") or {}).get("caBundle") == encoded for w in webhooks):
            return False
        for webhook in webhooks:
            webhook.setdefault("clientConfig", {})["caBundle"] = encoded
        try:
            await cluster.replace(config)
            return True
        except KubeConflict:
            continue
    raise RuntimeError(f"ValidatingWebhookConfiguration {name} kept changing; CA not patched")


class ServerTLS:
    """The SSL context the webhook server was started with, reloaded in place."""

    def __init__(self, directory: Path | None = None) -> None:
        self.context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        # kopf's server takes files; unless given a folder, they live in a private (0700) one
        # made on first use and removed on close.
        self._dir = directory
        self._owned = directory is None
        self._loaded: tuple[bytes, bytes] | None = None
        # Self-signed mode: the CA that also signs every pool's sidecar certificate
        # (kvbank.operator.pool_tls); None under cert-manager, which holds its own CA.
        self.issuer: CertBundle | None = None
        # Self-signed mode: the webhook configuration was not there to take the CA bundle at
        # the last refresh (the renewal loop then looks again every CA_RETRY_S).
        self.ca_pending = False

    def _folder(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvbank-webhook-"))
        return self._dir

    def close(self) -> None:
        """Remove the key from disk (only from a folder this object made)."""
        if self._owned and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def cert_file(self) -> Path:
        return self._folder() / "tls.crt"

    @property
    def key_file(self) -> Path:
        return self._folder() / "tls.key"

    def load(self, cert: bytes, key: bytes) -> bool:
        if self._loaded == (cert, key):
            return False
        self.key_file.touch(mode=0o600)
        self.key_file.write_bytes(key)
        self.cert_file.write_bytes(cert)
        self.context.load_cert_chain(self.cert_file, self.key_file)
        self._loaded = (cert, key)
        return True


async def refresh_tls(
    cluster: Cluster, settings: TLSSettings, server: ServerTLS, now: datetime
) -> bool:
    """Bring the served certificate up to date; True when it changed."""
    if settings.mode == "cert-manager":
        assert settings.cert_dir is not None
        cert = (settings.cert_dir / "tls.crt").read_bytes()
        key = (settings.cert_dir / "tls.key").read_bytes()
        return server.load(cert, key)
    bundle = await ensure_certificate(cluster, settings, now)
    server.issuer = bundle
    if settings.webhook_configuration:
        patched = await patch_ca_bundle(cluster, settings.webhook_configuration, bundle.ca_bundle)
        if patched and server.ca_pending:
            log.info(
                "CA bundle patched into ValidatingWebhookConfiguration %s",
                settings.webhook_configuration,
            )
        server.ca_pending = patched is None
    return server.load(bundle.cert, bundle.key)
