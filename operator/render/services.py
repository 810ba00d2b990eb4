"""The two Services of a pool and its PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from kvbank.operator.render.names import (
    LABEL_RANK,
    LWS_WORKER_INDEX,
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


def rank0_selector(owner: Owner, workload: Workload) -> dict[str, str]:
    """Only rank 0 takes requests. A LeaderWorkerSet labels its pods' worker index itself; a
    StatefulSet's pods get `kvbank.dev/rank` from the operator (see reconcile.rank_labels)."""
    key = LWS_WORKER_INDEX if workload is Workload.LEADER_WORKER_SET else LABEL_RANK
    return {**selector_labels(owner.name), key: "0"}


def traffic_service(owner: Owner, settings: RenderSettings, workload: Workload) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner.name, owner, "traffic"),
        "spec": {
            "type": "ClusterIP",
            "selector": rank0_selector(owner, workload),
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
