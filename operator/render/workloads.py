"""The pod groups: one group of tensorParallel pods per replica. A LeaderWorkerSet where its CRD
is installed (it restarts a group as a unit); otherwise one StatefulSet of replicas x TP pods
whose ordinal o is rank o % TP of group o // TP."""

from __future__ import annotations

from typing import Any

from kvbank.deployment import Deployment
from kvbank.modelpool import ModelPool
from kvbank.operator.render.engines import pods_per_group
from kvbank.operator.render.names import (
    LWS_API_VERSION,
    Owner,
    RenderSettings,
    Workload,
    headless_name,
    metadata,
    selector_labels,
)
from kvbank.operator.render.pods import pod_template
from kvbank.operator.render.sidecar_tls import PoolTLS


def stateful_set(
    pool: ModelPool,
    owner: Owner,
    settings: RenderSettings,
    config_hash: str,
    token_secret: str,
    deployment: Deployment | None = None,
    tls: PoolTLS | None = None,
) -> dict[str, Any]:
    deployment = deployment or Deployment()
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(owner.name, owner, "workload"),
        "spec": {
            "replicas": pool.replicas * pods_per_group(pool, deployment),
            "serviceName": headless_name(owner.name),
            # Every rank of a group must be up before the group serves; starting them in order
            # would only serialise the wait.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "selector": {"matchLabels": selector_labels(owner.name)},
            "template": pod_template(
                pool, settings, Workload.STATEFUL_SET, config_hash, token_secret, deployment, tls
            ),
        },
    }


def leader_worker_set(
    pool: ModelPool,
    owner: Owner,
    settings: RenderSettings,
    config_hash: str,
    token_secret: str,
    deployment: Deployment | None = None,
    tls: PoolTLS | None = None,
) -> dict[str, Any]:
    deployment = deployment or Deployment()
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(owner.name, owner, "workload"),
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": pods_per_group(pool, deployment),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(
                    pool,
                    settings,
                    Workload.LEADER_WORKER_SET,
                    config_hash,
                    token_secret,
                    deployment,
                    tls,
                ),
            },
        },
    }


def workload(
    kind: Workload,
    pool: ModelPool,
    owner: Owner,
    settings: RenderSettings,
    config_hash: str,
    token_secret: str,
    deployment: Deployment | None = None,
    tls: PoolTLS | None = None,
) -> dict[str, Any]:
    build = leader_worker_set if kind is Workload.LEADER_WORKER_SET else stateful_set
    return build(pool, owner, settings, config_hash, token_secret, deployment, tls)
