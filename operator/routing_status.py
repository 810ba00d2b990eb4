"""The pool's `Routing` condition, for a pool with `spec.routing.picker: kvbank`: whether the
cluster serves the InferencePool API the picker is named by.

Without it (the Gateway API Inference Extension's CRDs are not installed), the InferencePool is
left out of what is applied and the condition says so, with what to install; the picker's
Deployment, Service, RBAC and NetworkPolicies are still applied, so the picker is running and
ready when the CRD arrives, and the next reconcile or repair pass (every repair interval)
applies the InferencePool. A pool with `picker: none` has no Routing condition: one switched
back to none loses it with the picker's objects (`kvbank.operator.pruning.prune_picker`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbank.deployment import Deployment
from kvbank.operator.cluster import Cluster
from kvbank.operator.render.names import Owner
from kvbank.operator.render.picker import (
    INFERENCE_API_VERSION,
    INFERENCE_POOL,
    PICKER_PORT,
    picker_name,
)
from kvbank.operator.render.status import Condition

ROUTING = "Routing"
GAIE_CRDS = "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases"


def is_inference_pool(manifest: dict[str, Any]) -> bool:
    return (
        manifest.get("apiVersion") == INFERENCE_API_VERSION and manifest["kind"] == INFERENCE_POOL
    )


async def routable(
    cluster: Cluster, owner: Owner, deployment: Deployment, manifests: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Condition | None]:
    """What to apply of `manifests`, and the Routing condition (None: the pool has none)."""
    if deployment.picker != "kvbank":
        return list(manifests), None
    where = f"{owner.namespace}/{owner.name}"
    if await cluster.api_available(INFERENCE_API_VERSION):
        text = (
            f"InferencePool {where} names the picker Service {picker_name(owner.name)} "
            f"port {PICKER_PORT}: route to it with an HTTPRoute backendRef of group "
            "inference.networking.k8s.io, kind InferencePool"
        )
        return list(manifests), Condition(ROUTING, True, "InferencePoolRendered", text)
    text = (
        f"{where}: the cluster does not serve {INFERENCE_API_VERSION} (InferencePool), so no "
        f"InferencePool was rendered: install the Gateway API Inference Extension's CRDs "
        f"({GAIE_CRDS}, manifests/v1 CRDs); the picker {picker_name(owner.name)} runs "
        "meanwhile, and the InferencePool is applied at the next reconcile or repair"
    )
    kept = [m for m in manifests if not is_inference_pool(m)]
    return kept, Condition(ROUTING, False, "InferencePoolCRDMissing", text)


def without_routing(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pool's conditions less its Routing one, which would still name the InferencePool of
    a picker since removed."""
    kept = (c for c in status.get("conditions") or () if isinstance(c, Mapping))
    return [dict(c) for c in kept if c.get("type") != ROUTING]
