"""Which group and rank a pod is, read off what its workload controller stamped on it: a
StatefulSet's ordinal (rank = ordinal % TP, group = ordinal // TP) or a LeaderWorkerSet's
group and worker index. Pure functions over pod dicts."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.operator.render.names import (
    LABEL_POOL,
    LWS_GROUP_INDEX,
    LWS_WORKER_INDEX,
    STS_POD_INDEX,
)


@dataclass(frozen=True)
class RankedPod:
    name: str
    group: int
    rank: int
    ready: bool
    ip: str | None
    # <hostname>.<subdomain>.<namespace>.svc: a name the pool's sidecar certificate covers
    # (a pod IP is in no certificate), None for a pod outside any headless Service.
    dns: str | None = None


def _env(pod: Mapping[str, Any], name: str) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for var in container.get("env") or []:
            if var.get("name") == name and "value" in var:
                return str(var["value"])
    return None


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def ranked(pod: Mapping[str, Any]) -> RankedPod | None:
    """None for a pod that is not a kvbank rank or whose position cannot be read."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    name = str(meta.get("name") or "")
    if LABEL_POOL not in labels:
        return None
    ip = (pod.get("status") or {}).get("podIP")
    try:
        if LWS_WORKER_INDEX in labels:
            group, rank = int(labels[LWS_GROUP_INDEX]), int(labels[LWS_WORKER_INDEX])
        else:
            world = int(_env(pod, "KVBANK_WORLD_SIZE") or "")
            ordinal = int(labels.get(STS_POD_INDEX) or name.rsplit("-", 1)[-1])
            group, rank = divmod(ordinal, world)
    except (KeyError, ValueError, ZeroDivisionError):
        return None
    return RankedPod(name, group, rank, _ready(pod), ip, _dns(pod))


def _dns(pod: Mapping[str, Any]) -> str | None:
    spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
    host, subdomain = spec.get("hostname") or meta.get("name"), spec.get("subdomain")
    if not host or not subdomain:
        return None
    return f"{host}.{subdomain}.{meta.get('namespace') or 'default'}.svc"


def ready_groups(pods: Iterable[Mapping[str, Any]], tensor_parallel: int) -> int:
    """Groups with every one of their tensor_parallel ranks ready: a group serves only whole."""
    ready: dict[int, set[int]] = defaultdict(set)
    for pod in pods:
        position = ranked(pod)
        if position is not None and position.ready and position.rank < tensor_parallel:
            ready[position.group].add(position.rank)
    return sum(1 for ranks in ready.values() if len(ranks) == tensor_parallel)


def leaders(pods: Iterable[Mapping[str, Any]]) -> list[RankedPod]:
    """Rank-0 pods with an address, by group: their sidecars keep each group's ledger."""
    found = [p for p in (ranked(pod) for pod in pods) if p and p.rank == 0 and p.ip]
    return sorted(found, key=lambda p: p.group)
