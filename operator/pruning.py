"""Removing a pool's old ConfigMaps once no pod runs on them.

Each spec version has its own immutable ConfigMap (`render.names.config_name`), so a roll
leaves the old one behind for the old pods. It is deleted when it is not the current one and no
pod of the pool mounts it any more — checked after each reconcile and on the status timer,
which sees the roll finish. Owner references remove whatever is left with the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvbank.operator.cluster import Cluster
from kvbank.operator.render.names import LABEL_POOL


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
