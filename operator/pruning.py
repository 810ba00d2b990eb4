"""Removing what a pool no longer renders: its old ConfigMaps once no pod runs on them, and the
picker's objects once its `spec.routing.picker` is no longer kvbank.

Each spec version has its own immutable ConfigMap (`render.names.config_name`), so a roll
leaves the old one behind for the old pods. It is deleted when it is not the current one and no
pod of the pool mounts it any more — checked after each reconcile and on the status timer,
which sees the roll finish. The picker's objects (`render.picker.PICKER_OBJECTS`) are found
by the labels each carries, the pool's and its component, and deleted only when this pool owns
them, so an object someone else made with those labels stays; this runs at every reconcile of
a pool without a picker (a spec change, the operator's start), one list per kind. Owner
references remove whatever is left with the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvbank.operator.cluster import Cluster
from kvbank.operator.render.names import LABEL_POOL, Owner
from kvbank.operator.render.picker import INFERENCE_API_VERSION, PICKER_OBJECTS


def mounted_config_maps(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    names = set()
    for pod in pods:
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            name = (volume.get("configMap") or {}).get("name")
            if name:
                names.add(str(name))
    return names


def stale_config_maps(
    config_maps: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], current: str
) -> list[str]:
    in_use = mounted_config_maps(pods) | {current}
    names = (str((cm.get("metadata") or {}).get("name")) for cm in config_maps)
    return sorted(name for name in names if name not in in_use)


async def prune_config_maps(
    cluster: Cluster,
    namespace: str,
    pool: str,
    current: str,
    pods: Sequence[Mapping[str, Any]] | None = None,
) -> list[str]:
    """Delete the pool's ConfigMaps that are neither current nor mounted; returns their names."""
    selector = f"{LABEL_POOL}={pool},app.kubernetes.io/component=config"
    config_maps = await cluster.list("v1", "ConfigMap", namespace, label_selector=selector)
    if pods is None:
        pods = await cluster.list("v1", "Pod", namespace, label_selector=f"{LABEL_POOL}={pool}")
    stale = stale_config_maps(config_maps, pods, current)
    for name in stale:
        await cluster.delete("v1", "ConfigMap", name, namespace)
    return stale


def owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == owner.uid for ref in refs)


async def prune_picker(cluster: Cluster, owner: Owner, picker: str) -> list[str]:
    """Delete the picker's objects the pool owns unless its `picker` is kvbank; returns
    "Kind/name" of each one deleted. Where the cluster does not serve the InferencePool API
    there is no InferencePool to look for."""
    if picker == "kvbank":
        return []
    deleted = []
    for api_version, kind, component in PICKER_OBJECTS:
        if api_version == INFERENCE_API_VERSION and not await cluster.api_available(api_version):
            continue
        selector = f"{LABEL_POOL}={owner.name},app.kubernetes.io/component={component}"
        for obj in await cluster.list(api_version, kind, owner.namespace, label_selector=selector):
            name = str(obj["metadata"]["name"])
            if owned_by(obj, owner) and await cluster.delete(
                api_version, kind, name, owner.namespace
            ):
                deleted.append(f"{kind}/{name}")
    return deleted
