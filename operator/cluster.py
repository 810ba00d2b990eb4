"""What the operator's logic may ask of the Kubernetes API, and how failures come back.

`Cluster` is a Protocol so reconcile, admission and TLS logic depend on this file only, never on
a Kubernetes client library; `kvbank.operator.kube.KubeClient` is the one implementation that
talks to the API (an import-linter contract keeps it so), and tests substitute an in-memory one.

Failure policy, the same for every caller:
- 404: `get` -> None, `list` -> [] (the kind's CRD is not installed), `patch` -> None,
  `delete` -> False. Absence is an answer, not an error.
- `apply(dry_run=True)` answers what would be stored (defaults, canonical values, fields a
  disabled feature drops) and writes nothing.
- 409: `create` -> None (someone created it first; read it), `replace` -> KubeConflict (re-read
  and retry). `apply` is server-side apply with force, so field ownership never conflicts.
- Timeouts, connection errors, 429 and 5xx -> KubeUnavailable: retry later (the kopf handlers
  turn it into a TemporaryError with a delay).
- Any other status -> KubeError with the apiserver's message: the request itself was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvbank.modelpool import API_GROUP, API_VERSION

KVBANK = f"{API_GROUP}/{API_VERSION}"

# (apiVersion, kind) -> (plural, namespaced): every kind the operator reads or writes.
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "PersistentVolumeClaim"): ("persistentvolumeclaims", True),
    ("v1", "Namespace"): ("namespaces", False),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkersets", True),
    (KVBANK, "ModelPool"): ("modelpools", True),
    # What `spec.routing.picker: kvbank` renders (render.picker).
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("inference.networking.k8s.io/v1", "InferencePool"): ("inferencepools", True),
    (KVBANK, "CapacityPolicy"): ("capacitypolicies", False),
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): (
        "validatingwebhookconfigurations",
        False,
    ),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}" if status else message)


class KubeUnavailable(KubeError):
    """The API could not answer now (timeout, connection, 429, 5xx); retrying may succeed."""


class KubeConflict(KubeError):
    """The object changed since it was read (409 on replace)."""


def resource_path(
    api_version: str,
    kind: str,
    name: str | None = None,
    namespace: str | None = None,
    subresource: str | None = None,
) -> str:
    try:
        plural, namespaced = RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no REST mapping for {api_version} {kind}; add it to RESOURCES") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise ValueError(f"{kind} is namespaced: give a namespace")
        base += f"/namespaces/{namespace}"
    path = f"{base}/{plural}"
    if name:
        path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
    return path


def identity(manifest: Mapping[str, Any]) -> tuple[str, str, str | None, str]:
    """(apiVersion, kind, namespace, name) of a manifest."""
    meta = manifest.get("metadata") or {}
    return manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]


class Cluster(Protocol):
    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None: ...

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> list[dict[str, Any]]: ...

    async def apply(self, manifest: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply; `dry_run`: the object as it would be stored, nothing written."""
        ...

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None: ...

    async def replace(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None: ...

    async def delete(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> bool: ...

    async def api_available(self, group_version: str) -> bool: ...
