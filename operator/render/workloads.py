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


def workload_refusal(pool: ModelPool, deployment: Deployment, kind: Workload) -> str | None:
    """Why `kind` cannot run the pool with its traffic going to rank 0 alone, or None.

    A Service selects by equal labels only. Under one StatefulSet the ranks 0 are ordinals 0,
    TP, 2TP... and no label the StatefulSet controller stamps singles them out, so several
    groups of several pods would need the operator to label pods (patch on every pod in the
    cluster, and a traffic Service that goes wrong while the operator is down). Such a pool
    needs a LeaderWorkerSet, which labels each pod's worker index itself."""
    pods = pods_per_group(pool, deployment)
    if kind is Workload.LEADER_WORKER_SET or pods == 1 or pool.replicas == 1:
        return None
    return (
        f"spec.replicas={pool.replicas} with spec.tensorParallel={pool.tensor_parallel} runs "
        f"{pool.replicas} groups of {pods} pods, which needs a LeaderWorkerSet: in one "
        "StatefulSet no label picks out each group's rank 0 for the traffic Service. Install "
        "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) and recreate the pool, or lower "
        "spec.replicas to 1 (one pool per replica), or use spec.engine.kind vllm (one pod per "
        "group)"
    )


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
