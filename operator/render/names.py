"""Names, labels and ownership shared by every builder, and the settings that are not the spec's
(images, ports) but the operator's."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvbank.deployment import PodTemplate
from kvbank.modelpool import API_GROUP, API_VERSION, KIND

MANAGED_BY = "kvbank-operator"
LABEL_POOL = f"{API_GROUP}/pool"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
# The serial of the sidecar certificate a pod was started with: a renewed one rolls the pods,
# so no engine or sidecar keeps a certificate read at start past its expiry.
ANNOTATION_TLS_SERIAL = f"{API_GROUP}/sidecar-tls-serial"
LABEL_CONFIG_HASH = f"{API_GROUP}/config-hash"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
STS_POD_INDEX = "apps.kubernetes.io/pod-index"
# A folder of its own: a ConfigMap volume is read-only, so nothing (the API key, the sidecar's
# certificate) could be mounted inside it.
CONFIG_DIR = "/etc/kvbank/config"
POOL_FILE = "modelpool.yaml"
ENGINE_FILE = "engine.json"
# A fromConfig pool's config.json as it was judged, beside POOL_FILE, whose fromConfig.path
# names it: the ranks resolve it as `kvbank check` resolves a file beside a manifest.
MODEL_CONFIG_FILE = "model-config.json"


class Workload(StrEnum):
    STATEFUL_SET = "StatefulSet"
    LEADER_WORKER_SET = "LeaderWorkerSet"


@dataclass(frozen=True)
class Owner:
    """The ModelPool that owns what is rendered; its uid makes deletion cascade."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class RenderSettings:
    image: str = "ghcr.io/kvbank/kvbank:0.1.0"
    # The engine container of a `spec.engine.kind: vllm` pool without its own image.
    vllm_image: str = "ghcr.io/kvbank/kvbank-vllm:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    http_port: int = 8000
    sidecar_port: int = 50051
    metrics_port: int = 9464
    # Rank 0's torch.distributed store (KVBANK_DIST_PORT); the ranks' own gloo/NCCL links then
    # use ports the kernel picks, which is why the chart opens every port between a pool's ranks.
    dist_port: int = 29500
    gpu_resource: str = "nvidia.com/gpu"
    # Where the image (or a volume the chart mounts) holds the weights: MODEL_ROOT/model.name.
    model_root: str = "/models"
    # Long enough for admitted requests to finish on a pod being replaced (see docs/operator.md).
    termination_grace_seconds: int = 600
    # Whether the cluster mounts images as volumes (the ImageVolume feature): an `image` weights
    # source is then mounted, not copied at every start.
    image_volumes: bool = False
    # The chart's `pools.template`: what a pool's own spec.template leaves unset.
    template_defaults: PodTemplate = field(default_factory=PodTemplate)
    # The token every rendered sidecar requires (render.token); never in a repr, so no log of
    # these settings shows it. None renders no pods: they could not start.
    sidecar_token: str | None = field(default=None, repr=False)


def headless_name(pool: str) -> str:
    return f"{pool}-ranks"


def config_name(pool: str, config_hash: str) -> str:
    """One immutable ConfigMap per spec version: a pod keeps the config it started with for its
    whole life, so a rank restarting in an old pod never reads a newer (smaller) pool than its
    group's other ranks run."""
    return f"{pool}-engine-{config_hash[:10]}"


def selector_labels(pool: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvbank", LABEL_POOL: pool}


def labels(pool: str, component: str) -> dict[str, str]:
    return {
        **selector_labels(pool),
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def metadata(
    name: str, owner: Owner, component: str, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, component),
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta
