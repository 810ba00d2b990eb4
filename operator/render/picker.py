"""What `spec.routing.picker: kvbank` renders (docs/routing.md, "How the operator renders it"):
an InferencePool over the pool's rank-0 pods whose endpointPickerRef names `kvbank picker`'s
Service, and the picker itself: a Deployment of PICKER_REPLICAS that finds the pods with
`--selector` (the InferencePool's own selector), its Service, a ServiceAccount with a Role that
may only get/list/watch Pods in the pool's namespace, and two NetworkPolicies: the picker's own
(the gateway in, the sidecars, DNS and the API server out), and one that opens the rank pods'
sidecar port to the picker (NetworkPolicies add up: the chart's closes it to all but the ranks
and the operator). Every object is owned by the ModelPool, so it goes with it, and carries the
pool's label and a component of PICKER_OBJECTS, so a pool switched back to `picker: none` has
them removed (`kvbank.operator.pruning.prune_picker`).

The picker pods carry labels of their own (`app.kubernetes.io/name: kvbank-picker`), never the
rank selector's, so no Service, budget or InferencePool of the pool ever selects them."""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from kvbank.deployment import Deployment
from kvbank.modelpool import API_GROUP, ModelPool
from kvbank.operator.render.engines import TLS_CA_FILE, TLS_DIR, TLS_VOLUME, pods_per_group
from kvbank.operator.render.names import (
    CONFIG_DIR,
    MANAGED_BY,
    POOL_FILE,
    Owner,
    RenderSettings,
    Workload,
    config_name,
    metadata,
    selector_labels,
)
from kvbank.operator.render.security import (
    PROBE_TIMEOUT,
    container_security_context,
    pod_security_context,
    scratch_mount,
    scratch_volumes,
)
from kvbank.operator.render.services import rank0_selector
from kvbank.operator.render.sidecar_tls import PoolTLS
from kvbank.operator.render.token import TOKEN_FILE, token_mount, token_volume
from kvbank.operator.render.weights import model_path, weights

INFERENCE_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL = "InferencePool"
PICKER_PORT = 9002  # GAIE's endpoint picker port
PICKER_METRICS_PORT = 9090
PICKER_REPLICAS = 2
LABEL_PICKER = f"{API_GROUP}/picker"
PICKER_COMPONENT = "picker"
INFERENCE_POOL_COMPONENT = "inference-pool"
# (apiVersion, kind, app.kubernetes.io/component) of every object render_picker renders, in the
# order a pool switched back to `picker: none` has them deleted: the InferencePool first, so
# nothing routes to a picker being removed, then the reverse of the apply order.
PICKER_OBJECTS: tuple[tuple[str, str, str], ...] = (
    (INFERENCE_API_VERSION, INFERENCE_POOL, INFERENCE_POOL_COMPONENT),
    ("apps/v1", "Deployment", PICKER_COMPONENT),
    ("v1", "Service", PICKER_COMPONENT),
    ("networking.k8s.io/v1", "NetworkPolicy", PICKER_COMPONENT),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", PICKER_COMPONENT),
    ("rbac.authorization.k8s.io/v1", "Role", PICKER_COMPONENT),
    ("v1", "ServiceAccount", PICKER_COMPONENT),
)
# The tokenizer and the count are the picker's work: a few MiB of tokenizer, one body at a time
# per stream. No CPU limit (a throttled picker delays every request's first byte).
PICKER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
# The picker reads its model's tokenizer at start: weights on a claim or in an image mount at
# once, a download takes as long as the engine's.
PICKER_STARTUP_FAILURES = 360


def picker_name(pool: str) -> str:
    return f"{pool}-picker"


def picker_selector(pool: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvbank-picker", LABEL_PICKER: pool}


def picker_pod_labels(pool: str) -> dict[str, str]:
    return {
        **picker_selector(pool),
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": PICKER_COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def inference_pool(
    owner: Owner, settings: RenderSettings, workload: Workload, per_group: int
) -> dict[str, Any]:
    """The pool's rank-0 pods (the traffic Service's selector) on the engine's port; the picker
    fails closed: a request it cannot place is not sent blind past the ledgers."""
    return {
        "apiVersion": INFERENCE_API_VERSION,
        "kind": INFERENCE_POOL,
        "metadata": metadata(owner.name, owner, INFERENCE_POOL_COMPONENT),
        "spec": {
            "selector": {"matchLabels": rank0_selector(owner, workload, per_group)},
            "targetPorts": [{"number": settings.http_port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker_name(owner.name),
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def picker_args(
    pool: ModelPool, owner: Owner, settings: RenderSettings, selector: dict[str, str], tls: bool
) -> list[str]:
    args = [
        "kvbank", "picker",
        "--listen", f"0.0.0.0:{PICKER_PORT}",
        "--metrics-port", str(PICKER_METRICS_PORT),
        "--pool", f"{CONFIG_DIR}/{POOL_FILE}",
        "--model-dir", model_path(settings, pool.model_name),
        "--selector", selector_text(selector),
        "--namespace", owner.namespace,
        "--target-port", str(settings.http_port),
        "--sidecar-port", str(settings.sidecar_port),
        "--sidecar-token-file", TOKEN_FILE,
    ]  # fmt: skip
    return [*args, "--sidecar-ca-file", TLS_CA_FILE] if tls else args


def picker_probes() -> dict[str, Any]:
    """The kubelet's gRPC probe asks the picker's health services (the protocol's names):
    liveness while the process answers, readiness once every pod's first figures are in."""

    def probe(service: str, **timing: int) -> dict[str, Any]:
        return {"grpc": {"port": PICKER_PORT, "service": service},
                "timeoutSeconds": PROBE_TIMEOUT, **timing}  # fmt: skip

    return {
        "startupProbe": probe(
            "liveness", periodSeconds=5, failureThreshold=PICKER_STARTUP_FAILURES
        ),
        "readinessProbe": probe("readiness", periodSeconds=5, failureThreshold=3),
        "livenessProbe": probe("liveness", periodSeconds=10, failureThreshold=6),
    }


def picker_deployment(
    pool: ModelPool,
    owner: Owner,
    settings: RenderSettings,
    selector: dict[str, str],
    config_hash: str,
    token_secret: str,
    deployment: Deployment,
    tls: PoolTLS | None,
) -> dict[str, Any]:
    parts = weights(deployment.source, settings, pool.model_name)
    container: dict[str, Any] = {
        "name": "picker",
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": picker_args(pool, owner, settings, selector, tls is not None),
        "ports": [
            {"name": "ext-proc", "containerPort": PICKER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": PICKER_METRICS_PORT, "protocol": "TCP"},
        ],
        **picker_probes(),
        "resources": deepcopy(PICKER_RESOURCES),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            token_mount(),
            scratch_mount(),
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": config_name(pool.name, config_hash)}},
        token_volume(token_secret),
    ]
    if parts.volume is not None and parts.mount is not None:
        volumes.append(parts.volume)
        container["volumeMounts"].append(parts.mount)
    if tls is not None:  # the CA only: the sidecars' key stays theirs
        items = [{"key": "ca.crt", "path": "ca.crt"}]
        volumes.append(
            {"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name, "items": items}}
        )
        container["volumeMounts"].append(
            {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}
        )
    init = [
        {**c, "securityContext": container_security_context(),
         "volumeMounts": [*c.get("volumeMounts", []), scratch_mount()]}
        for c in parts.init_containers
    ]  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(picker_name(owner.name), owner, PICKER_COMPONENT),
        "spec": {
            "replicas": PICKER_REPLICAS,
            "selector": {"matchLabels": picker_selector(owner.name)},
            "template": {
                "metadata": {"labels": picker_pod_labels(owner.name)},
                "spec": {
                    "serviceAccountName": picker_name(owner.name),
                    "securityContext": pod_security_context(),
                    "initContainers": init,
                    "containers": [container],
                    "volumes": [*volumes, *scratch_volumes()],
                    # Two replicas on two nodes when the cluster has them.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": picker_selector(owner.name)},
                        }
                    ],
                },
            },
        },
    }


def picker_service(owner: Owner) -> dict[str, Any]:
    """What endpointPickerRef names; Envoy speaks gRPC (HTTP/2 without TLS) to it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(picker_name(owner.name), owner, PICKER_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(owner.name),
            "ports": [
                {
                    "name": "ext-proc",
                    "port": PICKER_PORT,
                    "targetPort": "ext-proc",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {"name": "metrics", "port": PICKER_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def picker_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The picker reads Pods in its pool's namespace and nothing else."""
    name = picker_name(owner.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(name, owner, PICKER_COMPONENT),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(name, owner, PICKER_COMPONENT),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(name, owner, PICKER_COMPONENT),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def tcp(port: int) -> dict[str, Any]:
    return {"port": port, "protocol": "TCP"}


def picker_network_policies(owner: Owner, settings: RenderSettings) -> list[dict[str, Any]]:
    """The picker: ext_proc and metrics in from any namespace (the gateway's is the cluster's
    choice); out, the pool's sidecars, DNS, and the API server (its address is the cluster's,
    so by port). The ranks: their sidecar port in from the picker pods."""
    sidecars = {"podSelector": {"matchLabels": selector_labels(owner.name)}}
    own = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(picker_name(owner.name), owner, PICKER_COMPONENT),
        "spec": {
            "podSelector": {"matchLabels": picker_selector(owner.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"namespaceSelector": {}}],
                 "ports": [tcp(PICKER_PORT), tcp(PICKER_METRICS_PORT)]},
            ],
            "egress": [
                {"to": [sidecars], "ports": [tcp(settings.sidecar_port)]},
                {"ports": [{"port": 53, "protocol": "UDP"}, tcp(53)]},
                {"ports": [tcp(443), tcp(6443)]},
            ],
        },
    }  # fmt: skip
    into_ranks = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(f"{picker_name(owner.name)}-to-sidecars", owner, PICKER_COMPONENT),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": picker_selector(owner.name)}}],
                    "ports": [tcp(settings.sidecar_port)],
                }
            ],
        },
    }
    return [own, into_ranks]


def render_picker(
    pool: ModelPool,
    owner: Owner,
    settings: RenderSettings,
    kind: Workload,
    deployment: Deployment,
    config_hash: str,
    token_secret: str,
    tls: PoolTLS | None,
) -> list[dict[str, Any]]:
    """The picker's objects, in apply order (its RBAC before its pods, the InferencePool
    last); none for a pool whose `spec.routing.picker` is not kvbank."""
    if deployment.picker != "kvbank":
        return []
    per_group = pods_per_group(pool, deployment)
    ip = inference_pool(owner, settings, kind, per_group)
    selector = ip["spec"]["selector"]["matchLabels"]
    return [
        *picker_rbac(owner),
        *picker_network_policies(owner, settings),
        picker_service(owner),
        picker_deployment(
            pool, owner, settings, selector, config_hash, token_secret, deployment, tls
        ),
        ip,
    ]
