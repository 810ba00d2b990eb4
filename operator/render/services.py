"""The two Services of a pool and its PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from kvbank.operator.render.names import (
    LWS_WORKER_INDEX,
    STS_POD_INDEX,
    Owner,
    RenderSettings,
    Workload,
    headless_name,
    metadata,
    selector_labels,
)


def headless_service(owner: Owner, settings: RenderSettings) -> dict[str, Any]:
    """Stable DNS names per rank, for followers' sidecars to find rank 0's. Not-ready addresses
    are published because a group's ranks must find each other before any of them is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(headless_name(owner.name), owner, "ranks"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": [{"name": "grpc", "port": settings.sidecar_port, "targetPort": "grpc"}],
        },
    }


def rank0_selector(owner: Owner, workload: Workload, pods_per_group: int) -> dict[str, str]:
    """Only rank 0 takes requests, chosen by labels the workload controller stamps, so traffic
    reaches the right pods with the operator down. A LeaderWorkerSet labels each pod's worker
    index; a StatefulSet only its ordinal (`apps.kubernetes.io/pod-index`, Kubernetes 1.28+).
    With one pod per group every pod is a rank 0; with several, ordinal 0 is rank 0 of the one
    group a StatefulSet pool may have (workloads.workload_refusal)."""
    if workload is Workload.LEADER_WORKER_SET:
        return {**selector_labels(owner.name), LWS_WORKER_INDEX: "0"}
    if pods_per_group == 1:
        return selector_labels(owner.name)
    return {**selector_labels(owner.name), STS_POD_INDEX: "0"}


def traffic_service(
    owner: Owner, settings: RenderSettings, workload: Workload, pods_per_group: int
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner.name, owner, "traffic"),
        "spec": {
            "type": "ClusterIP",
            "selector": rank0_selector(owner, workload, pods_per_group),
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }


def disruption_budget(owner: Owner) -> dict[str, Any]:
    """One pod at a time: losing any rank stops its whole group, so one pod is one group."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner.name, owner, "disruption-budget"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }
