"""The pool's sidecar certificate: a `kubernetes.io/tls` Secret `<pool>-sidecar-tls` (tls.crt,
tls.key, ca.crt), signed by the operator's CA, for every name a rank's sidecar is reached by:
its own engine on loopback, followers through the headless Service (StatefulSet) or the
LeaderWorkerSet's own, and the operator's status reads. Wildcards cover the pods, so scaling a
pool never needs a new certificate."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from kvbank.operator.render.names import Owner, headless_name, metadata


@dataclass(frozen=True)
class PoolTLS:
    """What the pods mount: the Secret, and the serial that rolls them when it is renewed."""

    secret_name: str
    serial: str


def tls_secret_name(pool: str) -> str:
    return f"{pool}-sidecar-tls"


def pool_tls_names(owner: Owner) -> tuple[str, ...]:
    names = ["localhost", "127.0.0.1"]
    for service in (headless_name(owner.name), owner.name):  # the StatefulSet's, the LWS's
        for suffix in ("", ".svc", ".svc.cluster.local"):
            base = f"{service}.{owner.namespace}{suffix}"
            names += [base, f"*.{base}"]
    return tuple(names)


def tls_secret(owner: Owner, cert: bytes, key: bytes, ca_bundle: bytes) -> dict[str, Any]:
    def encode(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(tls_secret_name(owner.name), owner, "sidecar-tls"),
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": encode(cert), "tls.key": encode(key), "ca.crt": encode(ca_bundle)},
    }
