"""Live pool figures and readiness, refreshed on a timer.

Each group's ledger lives in its rank-0 sidecar, so the operator asks every rank-0 sidecar for
its status — at most `concurrency` at a time, each within `timeout` seconds — and sums what
answered. A sidecar that does not answer makes the pool Degraded, never blocks the others.

`SidecarStatusSource` is the adapter the rest of the operator (and its tests) use; the one
implementation calls the sidecar's own client wrapper (`kvbank.sidecar.client`), imported only
when first used, so the operator carries no gRPC code of its own.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvbank.modelpool import KIND
from kvbank.operator.cluster import KVBANK, Cluster
from kvbank.operator.pruning import prune_config_maps
from kvbank.operator.ranks import RankedPod, leaders, ready_groups
from kvbank.operator.render.names import LABEL_POOL, config_name
from kvbank.operator.render.status import DEGRADED, READY, Condition, conditions
from kvbank.operator.weights_status import check_condition


@dataclass(frozen=True)
class PoolFigures:
    pages_total: int
    free_pages: int
    evictable_pages: int
    reserved_pages: int
    outstanding_pages: int
    queue_depth: int


FIELDS = tuple(PoolFigures.__dataclass_fields__)


class SidecarStatusSource(Protocol):
    async def status(
        self, address: str, timeout: float, server_name: str | None = None
    ) -> PoolFigures:
        """`server_name`: the name the sidecar's certificate must carry (TLS)."""
        ...


class SidecarClientSource:
    """Reads `status()` through the sidecar's own client wrapper (`kvbank.sidecar.client`,
    blocking gRPC, so in a worker thread), with its deadline and retry budget both held to
    `timeout` so one slow sidecar costs at most that."""

    def __init__(self, token: str | None = None) -> None:
        self._token = token
        # The CA that signs the pools' sidecar certificates (set once the operator holds it):
        # with it, status reads are TLS to the name the certificate covers.
        self.ca_bundle: bytes | None = None

    def _read(self, address: str, timeout: float, server_name: str | None) -> PoolFigures:
        client_module = importlib.import_module("kvbank.sidecar.client")
        with client_module.SidecarClient(
            address,
            token=self._token,
            tls_ca=self.ca_bundle,
            tls_server_name=server_name,
            deadline_s=timeout,
            retry_budget_s=timeout,
        ) as client:
            pool = client.status()
        return PoolFigures(
            pages_total=pool.total_pages,
            free_pages=pool.free,
            evictable_pages=pool.evictable,
            reserved_pages=pool.reserved,
            outstanding_pages=pool.outstanding,
            queue_depth=pool.waiting,
        )

    async def status(
        self, address: str, timeout: float, server_name: str | None = None
    ) -> PoolFigures:
        return await asyncio.to_thread(self._read, address, timeout, server_name)


@dataclass(frozen=True)
class Poll:
    figures: dict[str, int]
    reporting: int
    failures: tuple[str, ...]  # "pod: reason" per sidecar that did not answer


async def poll_sidecars(
    source: SidecarStatusSource,
    ranks: Sequence[RankedPod],
    port: int,
    *,
    concurrency: int,
    timeout: float,
    by_name: bool = False,
) -> Poll:
    """`by_name`: check each sidecar's certificate for its pod's DNS name, which the pool's
    certificate covers (a pod IP is in none); the dial is still to the IP, so an operator
    outside the cluster's DNS reads it too."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(pod: RankedPod) -> PoolFigures | str:
        name = pod.dns if by_name else None
        async with gate:
            try:
                return await asyncio.wait_for(
                    source.status(f"{pod.ip}:{port}", timeout, name), timeout
                )
            except TimeoutError:
                return f"{pod.name}: no answer within {timeout:g}s"
            except Exception as exc:  # any failure of one sidecar is that sidecar's, reported
                return f"{pod.name}: {type(exc).__name__}: {exc}"

    answers = await asyncio.gather(*(one(pod) for pod in ranks))
    totals = dict.fromkeys(FIELDS, 0)
    failures = []
    for answer in answers:
        if isinstance(answer, str):
            failures.append(answer)
            continue
        for name in FIELDS:
            totals[name] += getattr(answer, name)
    return Poll(totals, len(ranks) - len(failures), tuple(failures))


def _accepted(doc: Mapping[str, Any]) -> bool:
    for cond in (doc.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Accepted":
            return bool(cond.get("status") == "True")
    return False


async def refresh(
    cluster: Cluster,
    source: SidecarStatusSource,
    doc: Mapping[str, Any],
    *,
    port: int,
    concurrency: int,
    timeout: float,
    now: str,
) -> dict[str, Any] | None:
    """Patch readiness and live figures into the pool's status; returns the patch (None for a
    pool not accepted, which runs nothing to read)."""
    if not _accepted(doc):
        return None
    meta, spec = doc["metadata"], doc.get("spec") or {}
    name, namespace = meta["name"], meta.get("namespace") or "default"
    replicas, tp = int(spec.get("replicas", 1)), int(spec.get("tensorParallel", 1))
    if (spec.get("engine") or {}).get("kind") == "vllm":
        tp = 1  # vLLM runs a group's ranks in one pod (render.engines)
    pods = await cluster.list("v1", "Pod", namespace, label_selector=f"{LABEL_POOL}={name}")
    config_hash = (doc.get("status") or {}).get("configHash")
    if config_hash:  # the roll may have finished: old configs nobody mounts can go
        await prune_config_maps(cluster, namespace, name, config_name(name, config_hash), pods)
    ready = ready_groups(pods, tp)
    ranks = [p for p in leaders(pods) if p.ready]
    tls = bool((doc.get("status") or {}).get("sidecarTLS"))
    poll = await poll_sidecars(
        source, ranks, port, concurrency=concurrency, timeout=timeout, by_name=tls
    )
    problems = list(poll.failures)
    if ready < replicas:
        problems.insert(0, f"{ready} of {replicas} groups have every rank ready")
    generation = int(meta.get("generation") or 0)
    updates = [
        Condition(
            READY,
            ready >= replicas,
            "GroupsReady" if ready >= replicas else "GroupsNotReady",
            f"{ready} of {replicas} groups ready",
        ),
        Condition(
            DEGRADED,
            bool(problems),
            "SidecarsUnreachable"
            if poll.failures
            else "GroupsNotReady"
            if problems
            else "AsExpected",
            "; ".join(problems),
        ),
    ]
    weights = check_condition(pods)
    if weights is not None:
        updates.append(weights)
    live = {
        "pagesTotal": poll.figures["pages_total"],
        "freePages": poll.figures["free_pages"],
        "evictablePages": poll.figures["evictable_pages"],
        "reservedPages": poll.figures["reserved_pages"],
        "outstandingPages": poll.figures["outstanding_pages"],
        "queueDepth": poll.figures["queue_depth"],
        "sidecarsReporting": poll.reporting,
        "sidecarsExpected": replicas,
        "updatedAt": now,
    }
    current = (doc.get("status") or {}).get("conditions")
    status = {
        "readyReplicas": ready,
        "live": live,
        "conditions": conditions(current, updates, generation, now),
    }
    await cluster.patch(KVBANK, KIND, name, namespace, {"status": status}, "status")
    return status
