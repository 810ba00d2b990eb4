"""Issuing and renewing each pool's sidecar certificate (render.sidecar_tls says what it holds).

The operator may create Secrets in a pool's namespace and update them, but never read one
(RBAC: nothing that returns another Secret's data), so what it issued is recorded in the pool's
status (`status.sidecarTLS`: serial, expiry, names and CA). A certificate is renewed when a
third of its life is left, its names or CA changed, or its Secret was deleted: every pass tries
a create, which answers 409 while the Secret is there and restores it when it is not. The serial
is stamped on the pod template, so a renewed certificate rolls the pods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kvbank.operator.certs import CertBundle, fingerprint, new_serving, serial_and_expiry
from kvbank.operator.cluster import Cluster
from kvbank.operator.render.names import Owner
from kvbank.operator.render.sidecar_tls import PoolTLS, pool_tls_names, tls_secret, tls_secret_name

POOL_CERT_LIFETIME = timedelta(days=90)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def names_digest(names: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def renewal_due(
    record: Mapping[str, Any], names: tuple[str, ...], ca: str, now: datetime
) -> str | None:
    """Why the recorded certificate must be renewed, or None while it is good."""
    if not record.get("serial") or not record.get("notAfter"):
        return "none issued"
    if record.get("names") != names_digest(names):
        return "its names changed"
    if record.get("ca") != ca:
        return "the operator's CA changed"
    try:
        not_after = datetime.strptime(str(record["notAfter"]), TIME_FORMAT).replace(
            tzinfo=now.tzinfo
        )
    except ValueError:
        return "its recorded expiry is unreadable"
    if not_after - now < POOL_CERT_LIFETIME / 3:
        return "a third of its life is left"
    return None


async def ensure_pool_tls(
    cluster: Cluster,
    owner: Owner,
    status: Mapping[str, Any],
    issuer: CertBundle | None,
    now: datetime,
) -> tuple[PoolTLS | None, dict[str, Any] | None]:
    """(what the pods mount, the status record) — (None, None) when the operator has no CA, and
    the pods then run their sidecars on a trusted network (docs/operator.md)."""
    if issuer is None:
        return None, None
    names = pool_tls_names(owner)
    ca = fingerprint(issuer.ca_bundle)
    record = dict(status.get("sidecarTLS") or {})
    due = renewal_due(record, names, ca, now)
    cert, key = new_serving(issuer.ca_cert, issuer.ca_key, names, now, POOL_CERT_LIFETIME)
    manifest = tls_secret(owner, cert, key, issuer.ca_bundle)
    created = await cluster.create(manifest) is not None
    if not created and due is None:
        return PoolTLS(tls_secret_name(owner.name), str(record["serial"])), record
    if not created:
        await cluster.replace(manifest)  # an unconditional update: nothing of the old is read
    serial, not_after = serial_and_expiry(cert)
    record = {
        "secret": tls_secret_name(owner.name),
        "serial": serial,
        "notAfter": not_after.strftime(TIME_FORMAT),
        "names": names_digest(names),
        "ca": ca,
    }
    return PoolTLS(tls_secret_name(owner.name), serial), record
