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

from copy import deepcopy
from typing import Any

from kvbank.deployment import Deployment
from kvbank.modelpool import ModelPool
from kvbank.operator.render.engines import (
    api_key_mount,
    api_key_volume,
    engine_command,
    engine_labels,
    engine_sidecar_address,
    is_vllm,
    pods_per_group,
    ranks_per_pod,
    sidecar_args,
    socket_mount,
    socket_volume,
    tls_mount,
    tls_volume,
)
from kvbank.operator.render.names import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_TLS_SERIAL,
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
from kvbank.operator.render.scheduling import engine_resources, placement, shm_mount, shm_volume
from kvbank.operator.render.security import (
    LIVE_PATH,
    READY_PATH,
    SIDECAR_RESOURCES,
    cache_env,
    cache_mount,
    engine_probes,
    harden,
    pod_security_context,
    scratch_volumes,
    sidecar_probes,
)
from kvbank.operator.render.sidecar_tls import PoolTLS
from kvbank.operator.render.token import token_mount, token_volume
from kvbank.operator.render.weights import weights

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


def rank_env(
    pool: ModelPool,
    settings: RenderSettings,
    workload: Workload,
    deployment: Deployment | None = None,
) -> list[dict[str, Any]]:
    """KVBANK_WORLD_SIZE counts pods, not GPUs: a vLLM pod runs its group's ranks itself.
    KVBANK_SIDECAR_ADDR is where this pod's engine calls its sidecar."""
    deployment = deployment or Deployment()
    world = pods_per_group(pool, deployment)
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "POD_IP", **_field("status.podIP")},
        {"name": "KVBANK_WORLD_SIZE", "value": str(world)},
        {"name": "KVBANK_WORKLOAD", "value": pool.name},
        {"name": "KVBANK_HEADLESS", "value": headless_name(pool.name)},
        {"name": "KVBANK_DIST_PORT", "value": str(settings.dist_port)},
        {"name": "KVBANK_SIDECAR_PORT", "value": str(settings.sidecar_port)},
        {"name": "KVBANK_SIDECAR_ADDR", "value": engine_sidecar_address(settings, deployment)},
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


def _container(
    name: str,
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    probes: dict[str, Any],
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
        **probes,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            token_mount(),
            socket_mount(),
        ],
    }


def pod_template(
    pool: ModelPool,
    settings: RenderSettings,
    workload: Workload,
    config_hash: str,
    token_secret: str,
    deployment: Deployment | None = None,
    tls: PoolTLS | None = None,
) -> dict[str, Any]:
    """`token_secret`: the name of the pool's token Secret (render.token), mounted read-only into
    both containers. `tls`: the pool's sidecar certificate Secret, when the operator has a CA."""
    deployment = deployment or Deployment()
    template = deployment.template.over(settings.template_defaults)
    parts = weights(deployment.source, settings, pool.model_name)
    env = rank_env(pool, settings, workload, deployment)
    command = engine_command(pool, settings, deployment, tls is not None)
    engine = _container(
        "engine",
        command.args,
        env + cache_env() + command.env,
        [
            {"name": "http", "containerPort": settings.http_port, "protocol": "TCP"},
            # Only rank 0's is listened on; every rank gets it so the pod template is one.
            {"name": "dist", "containerPort": settings.dist_port, "protocol": "TCP"},
        ],
        engine_probes("http", READY_PATH if is_vllm(deployment) else LIVE_PATH),
        workload,
        settings,
    )
    engine["image"] = command.image
    gpus = template.gpus_per_rank * ranks_per_pod(pool, deployment)
    engine["resources"] = engine_resources(template, settings, gpus)
    sidecar = _container(
        "sidecar",
        sidecar_args(settings, tls is not None),
        env,
        [
            {"name": "grpc", "containerPort": settings.sidecar_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"},
        ],
        # The kubelet's gRPC probe speaks plaintext only: behind TLS, the sidecar is probed as
        # a listening socket instead.
        sidecar_probes(
            {"tcpSocket": {"port": "grpc"}}
            if tls is not None
            else {"grpc": {"port": settings.sidecar_port}}
        ),
        workload,
        settings,
    )
    sidecar["resources"] = deepcopy(SIDECAR_RESOURCES)
    engine["volumeMounts"].append(cache_mount())
    volumes = [
        {"name": "config", "configMap": {"name": config_name(pool.name, config_hash)}},
        token_volume(token_secret),
    ]
    if parts.volume is not None and parts.mount is not None:
        volumes.append(parts.volume)
        engine["volumeMounts"].append(parts.mount)
    shm = shm_volume(template)
    if shm is not None:
        volumes.append(shm)
        engine["volumeMounts"].append(shm_mount())
    if deployment.api_key is not None:
        volumes.append(api_key_volume(deployment.api_key))
        engine["volumeMounts"].append(api_key_mount())
    annotations = {ANNOTATION_CONFIG_HASH: config_hash}
    if tls is not None:
        volumes.append(tls_volume(tls.secret_name))
        engine["volumeMounts"].append(tls_mount())
        sidecar["volumeMounts"].append(tls_mount())
        annotations[ANNOTATION_TLS_SERIAL] = tls.serial
    return {
        "metadata": {
            "labels": {**labels(pool.name, "rank"), **engine_labels(deployment)},
            "annotations": annotations,
        },
        "spec": {
            "securityContext": pod_security_context(template.security),
            "terminationGracePeriodSeconds": settings.termination_grace_seconds,
            # A Service named vllm in the namespace (a pool named vllm has one) would put
            # VLLM_PORT=tcp://... into the environment, which vLLM reads as its own port
            # setting and refuses; nothing in the pod reads Service variables.
            **({"enableServiceLinks": False} if is_vllm(deployment) else {}),
            "initContainers": [harden(c) for c in parts.init_containers],
            "containers": [harden(engine), harden(sidecar)],
            "volumes": [*volumes, socket_volume(), *scratch_volumes()],
            **placement(template, pool.name),
        },
    }
