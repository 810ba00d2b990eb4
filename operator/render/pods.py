"""The pod every rank runs: the engine and its admission sidecar.

Each pod's `kvbank serve` is one rank: it reads KVBANK_RANK, KVBANK_WORLD_SIZE, KVBANK_RANK0_ADDR
and KVBANK_DIST_PORT (kvbank.engine.tp.pod), joins torch.distributed at rank 0's store, and
follows rank 0's admission decisions over that process group, as the ranks of `kvbank serve --tp`
do; a follower's own sidecar is not in that path yet (docs/operator.md says what it would take).
Rank, world size and the rank-0 address reach both containers by environment (the contract is
in docs/operator.md). Under a
StatefulSet the ordinal gives group and rank, which needs arithmetic no env reference can do,
so a four-line POSIX shell prelude computes them and then execs the real command.
"""

from __future__ import annotations

from typing import Any

from kvbank.capacity import pool_pages
from kvbank.modelpool import ModelPool
from kvbank.operator.render.names import (
    ANNOTATION_CONFIG_HASH,
    CONFIG_DIR,
    LWS_GROUP_INDEX,
    LWS_WORKER_INDEX,
    POOL_FILE,
    RenderSettings,
    Workload,
    config_name,
    headless_name,
    labels,
)
from kvbank.operator.render.token import TOKEN_FILE, token_mount, token_volume

STATEFUL_SET_PRELUDE = """set -eu
ordinal="${POD_NAME##*-}"
export KVBANK_GROUP=$((ordinal / KVBANK_WORLD_SIZE))
export KVBANK_RANK=$((ordinal % KVBANK_WORLD_SIZE))
leader="${KVBANK_WORKLOAD}-$((KVBANK_GROUP * KVBANK_WORLD_SIZE))"
export KVBANK_RANK0_ADDR="${leader}.${KVBANK_HEADLESS}.${POD_NAMESPACE}.svc"
export KVBANK_RANK0_SIDECAR="${KVBANK_RANK0_ADDR}:${KVBANK_SIDECAR_PORT}"
exec "$@"
"""

LEADER_WORKER_SET_PRELUDE = """set -eu
leader="${KVBANK_WORKLOAD}-${KVBANK_GROUP}.${KVBANK_WORKLOAD}.${POD_NAMESPACE}"
export KVBANK_RANK0_ADDR="${LWS_LEADER_ADDRESS:-${leader}}"
export KVBANK_RANK0_SIDECAR="${KVBANK_RANK0_ADDR}:${KVBANK_SIDECAR_PORT}"
exec "$@"
"""


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def rank_env(pool: ModelPool, settings: RenderSettings, workload: Workload) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "POD_IP", **_field("status.podIP")},
        {"name": "KVBANK_WORLD_SIZE", "value": str(pool.tensor_parallel)},
        {"name": "KVBANK_WORKLOAD", "value": pool.name},
        {"name": "KVBANK_HEADLESS", "value": headless_name(pool.name)},
        {"name": "KVBANK_DIST_PORT", "value": str(settings.dist_port)},
        {"name": "KVBANK_SIDECAR_PORT", "value": str(settings.sidecar_port)},
        {"name": "KVBANK_SIDECAR_ADDR", "value": f"127.0.0.1:{settings.sidecar_port}"},
        {"name": "KVBANK_POOL_FILE", "value": f"{CONFIG_DIR}/{POOL_FILE}"},
    ]
    if workload is Workload.LEADER_WORKER_SET:
        env += [
            {"name": "KVBANK_RANK", **_field(f"metadata.labels['{LWS_WORKER_INDEX}']")},
            {"name": "KVBANK_GROUP", **_field(f"metadata.labels['{LWS_GROUP_INDEX}']")},
        ]
    return env


def prelude(workload: Workload) -> list[str]:
    script = (
        STATEFUL_SET_PRELUDE if workload is Workload.STATEFUL_SET else LEADER_WORKER_SET_PRELUDE
    )
    return ["/bin/sh", "-c", script, "kvbank-rank"]


# The spec's admission policy and backfill, as `kvbank serve --policy` names them. The sidecar
# runs each of these ledgers (it reads the same spec.admission from --pool), so every engine
# keeps its ledger there, and none waits on it within a step (kvbank.engine.admission.peak).


def engine_args(pool: ModelPool, settings: RenderSettings) -> list[str]:
    """`kvbank serve` with the pool's own figures, so the engine admits by the same numbers the
    webhook judged (the pages resolved, memoryFraction included)."""
    policy = pool.admission.ledger_policy
    sidecar = [
        "--sidecar",
        f"127.0.0.1:{settings.sidecar_port}",
        "--sidecar-token-file",
        TOKEN_FILE,
    ]
    return [
        "kvbank",
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(settings.http_port),
        *sidecar,
        "--model",
        f"{settings.model_root}/{pool.model_name}",
        "--pages",
        str(pool_pages(pool)),
        "--page-size",
        str(pool.kv.page_size),
        "--max-seq-len",
        str(pool.limits.max_seq_len),
        "--max-tokens",
        str(pool.limits.max_tokens),
        "--policy",
        policy,
    ]


def _container(
    name: str,
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    probe: dict[str, Any],
    workload: Workload,
    settings: RenderSettings,
) -> dict[str, Any]:
    return {
        "name": name,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": prelude(workload),
        "args": args,
        "env": env,
        "ports": ports,
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            token_mount(),
        ],
    }


def sidecar_args(settings: RenderSettings) -> list[str]:
    """`kvbank sidecar` on the pod address, so the operator can read its status; that needs the
    shared token, which its engine sends too (--sidecar-token-file)."""
    return [
        "kvbank",
        "sidecar",
        "--listen",
        f"0.0.0.0:{settings.sidecar_port}",
        "--token-file",
        TOKEN_FILE,
        # No certificate is rendered for the sidecar yet: the pod network is declared trusted,
        # which `kvbank sidecar` requires of a token sent without TLS.
        "--trusted-network",
        "--metrics-port",
        str(settings.metrics_port),
        "--metrics-host",
        "0.0.0.0",
        "--pool",
        f"{CONFIG_DIR}/{POOL_FILE}",
    ]


def pod_template(
    pool: ModelPool,
    settings: RenderSettings,
    workload: Workload,
    config_hash: str,
    token_secret: str,
) -> dict[str, Any]:
    """`token_secret`: the name of the pool's token Secret (render.token), mounted read-only into
    both containers."""
    env = rank_env(pool, settings, workload)
    engine = _container(
        "engine",
        engine_args(pool, settings),
        env,
        [
            {"name": "http", "containerPort": settings.http_port, "protocol": "TCP"},
            # Only rank 0's is listened on; every rank gets it so the pod template is one.
            {"name": "dist", "containerPort": settings.dist_port, "protocol": "TCP"},
        ],
        {"httpGet": {"path": "/health", "port": "http"}},
        workload,
        settings,
    )
    engine["resources"] = {"limits": {settings.gpu_resource: 1}}
    sidecar = _container(
        "sidecar",
        sidecar_args(settings),
        env,
        [
            {"name": "grpc", "containerPort": settings.sidecar_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"},
        ],
        {"grpc": {"port": settings.sidecar_port}},
        workload,
        settings,
    )
    return {
        "metadata": {
            "labels": labels(pool.name, "rank"),
            "annotations": {ANNOTATION_CONFIG_HASH: config_hash},
        },
        "spec": {
            "terminationGracePeriodSeconds": settings.termination_grace_seconds,
            "containers": [engine, sidecar],
            "volumes": [
                {"name": "config", "configMap": {"name": config_name(pool.name, config_hash)}},
                token_volume(token_secret),
            ],
        },
    }
