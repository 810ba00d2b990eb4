"""Where a rank's pod may run and what it asks of its node: `spec.template` laid over the chart's
`pools.template` defaults (`PodTemplate.over`), rendered into the pod spec.

GPUs are limits (an extended resource is never overcommitted, so its request equals its
limit); CPU and memory are requests, which is what the scheduler places by, and memory is the
limit too: an engine past its memory is killed alone rather than pushing its node's other pods
out, and the pod's memory is what the scheduler counted. CPU has no limit (a throttled engine
stalls every request's decode). `shmSize` is an
in-memory emptyDir at /dev/shm, because the container runtime's 64 MiB default is too small for
the tokenizer's and NCCL's shared-memory segments. A spread constraint with no labelSelector
spreads the pool's own pods.
"""

from __future__ import annotations

from typing import Any

from kvbank.deployment import PodTemplate
from kvbank.operator.render.names import RenderSettings, selector_labels

SHM_VOLUME = "dshm"


def engine_resources(template: PodTemplate, settings: RenderSettings, gpus: int) -> dict[str, Any]:
    """`gpus`: what the engine container asks for (gpusPerRank, times TP for a vLLM pod)."""
    resources: dict[str, Any] = {}
    requests = {
        k: v
        for k, v in (("cpu", template.resources.cpu), ("memory", template.resources.memory))
        if v
    }
    if requests:
        resources["requests"] = requests
    limits: dict[str, Any] = {}
    if template.resources.memory:
        limits["memory"] = template.resources.memory
    if gpus:
        limits[settings.gpu_resource] = gpus
    if limits:
        resources["limits"] = limits
    return resources


def shm_volume(template: PodTemplate) -> dict[str, Any] | None:
    if not template.shm_size:
        return None
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": template.shm_size}}


def shm_mount() -> dict[str, Any]:
    return {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def _spread(template: PodTemplate, pool: str) -> list[dict[str, Any]]:
    rules = []
    for rule in template.topology_spread_constraints or ():
        rendered = dict(rule)
        rendered.setdefault("labelSelector", {"matchLabels": selector_labels(pool)})
        rules.append(rendered)
    return rules


def placement(template: PodTemplate, pool: str) -> dict[str, Any]:
    """The pod-spec fields of `template` that are set, in the pod spec's own words."""
    spec: dict[str, Any] = {}
    if template.node_selector:
        spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        spec["tolerations"] = [dict(t) for t in template.tolerations]
    if template.affinity:
        spec["affinity"] = dict(template.affinity)
    if template.topology_spread_constraints:
        spec["topologySpreadConstraints"] = _spread(template, pool)
    if template.priority_class_name:
        spec["priorityClassName"] = template.priority_class_name
    if template.runtime_class_name:
        spec["runtimeClassName"] = template.runtime_class_name
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in template.image_pull_secrets]
    return spec
