"""The Secret that carries the sidecar token into a pool's pods.

Every rank's sidecar listens on the pod address (the operator reads its status there), and
`kvbank sidecar` refuses that without `--token-file`; its engine must send the same token. The
operator holds one token (`--sidecar-token`, which the chart fills from its own Secret) and
renders a copy into each pool's namespace, because a pod can mount only a Secret of its own
namespace.

The Secret is immutable and named by a fingerprint of the token, as the ConfigMap is named by its
content hash: a new token gives a new Secret name, so the pod template changes and the pods roll,
and no running pod ever sees its token file change under it (an engine and a sidecar that read
the file at different times would disagree). The operator only ever *creates* it: a create that
finds it there changes nothing, and so its RBAC needs `create` on Secrets and nothing that
returns one's data (server-side apply answers with the whole object, so `patch` would let it read
every Secret in the cluster). A Secret of an earlier token stays until its pool is deleted.

The fingerprint is PBKDF2 over the token, salted with the pool's uid: it appears in object names
anyone with `get statefulsets` can read, so it must not let them test guesses at a weak token
cheaply, and the uid makes a pool recreated under the same name render a Secret of its own.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from typing import Any

from kvbank.operator.render.names import Owner, metadata

TOKEN_DIR = "/var/run/kvbank/sidecar-token"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
TOKEN_VOLUME = "sidecar-token"
# About 50 ms once per token and pool (then cached); each guess at the token costs as much.
FINGERPRINT_ITERATIONS = 100_000


class MissingSidecarToken(ValueError):
    """The operator was started without a token, so no pod it renders could start."""


@functools.lru_cache(maxsize=4096)
def token_fingerprint(token: str, pool_uid: str) -> str:
    salt = f"kvbank.dev/sidecar-token/{pool_uid}".encode()
    digest = hashlib.pbkdf2_hmac("sha256", token.encode(), salt, FINGERPRINT_ITERATIONS)
    return digest.hex()[:10]


def token_secret_name(pool: str, fingerprint: str) -> str:
    return f"{pool}-sidecar-token-{fingerprint}"


def token_secret(owner: Owner, token: str | None) -> dict[str, Any]:
    """The pool's copy of the operator's token, owned by the pool so it goes with it."""
    if not token:
        raise MissingSidecarToken(
            "the operator has no sidecar token, and every rank's sidecar needs one to listen on "
            "its pod address: set KVBANK_SIDECAR_TOKEN or --sidecar-token on the operator "
            "(the chart sets it from its Secret; see sidecarToken in its values)"
        )
    name = token_secret_name(owner.name, token_fingerprint(token, owner.uid))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(name, owner, "sidecar-token"),
        "type": "Opaque",
        "immutable": True,
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_volume(secret_name: str) -> dict[str, Any]:
    return {
        "name": TOKEN_VOLUME,
        "secret": {"secretName": secret_name, "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]},
    }


def token_mount() -> dict[str, Any]:
    return {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}
