"""Reconcile one ModelPool: judge it again, render it, apply it, report.

Judging again is what makes the webhook an optimisation, not the guarantee: a spec that slipped
past (webhook down, failurePolicy Ignore) or two applies that raced a quota end with
Accepted=False and the message, and nothing new is rendered — what already runs keeps running
the last accepted spec. Applying is server-side apply of complete manifests with owner
references, so running it twice, or after a restart half-way, converges on the same objects and
creates nothing twice; deleting the ModelPool lets the garbage collector remove them.

An operator started without the sidecar token renders nothing either: every rank's sidecar
would refuse to start. The pool says so (Accepted and Ready False, reason SidecarTokenMissing)
with how to set it; restarting the operator with a token renders it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvbank.modelpool import KIND
from kvbank.operator.admission import Decision, judge, message, neighbourhood
from kvbank.operator.cluster import KVBANK, Cluster
from kvbank.operator.pruning import prune_config_maps
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import (
    LWS_API_VERSION,
    Owner,
    RenderSettings,
    Workload,
    config_name,
)
from kvbank.operator.render.status import ACCEPTED, READY, Condition, status_patch
from kvbank.operator.render.token import MissingSidecarToken


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Outcome:
    accepted: bool
    message: str
    applied: tuple[str, ...] = ()  # "Kind/name" of every object applied


def owner_of(doc: Mapping[str, Any]) -> Owner:
    meta = doc["metadata"]
    return Owner(str(meta["name"]), str(meta.get("namespace") or "default"), str(meta["uid"]))


async def patch_status(cluster: Cluster, owner: Owner, status: Mapping[str, Any]) -> None:
    await cluster.patch(
        KVBANK, KIND, owner.name, owner.namespace, {"status": dict(status)}, "status"
    )


async def choose_workload(cluster: Cluster, doc: Mapping[str, Any]) -> Workload:
    """Once chosen, a pool keeps its workload kind: installing LeaderWorkerSet later must not
    tear down running StatefulSets (recreate the pool to switch)."""
    recorded = (doc.get("status") or {}).get("workload")
    if recorded in {w.value for w in Workload}:
        return Workload(recorded)
    if await cluster.api_available(LWS_API_VERSION):
        return Workload.LEADER_WORKER_SET
    return Workload.STATEFUL_SET


async def _refuse(
    cluster: Cluster, owner: Owner, decision: Decision, doc: Mapping[str, Any], now: str
) -> Outcome:
    """Accepted=False with every violation; nothing rendered, nothing running touched."""
    text = message(owner.namespace, owner.name, decision)
    update = Condition(ACCEPTED, False, decision.reason, text)
    await patch_status(cluster, owner, status_patch(doc, [update], now))
    return Outcome(False, text)


async def _refuse_untokened(
    cluster: Cluster, owner: Owner, error: MissingSidecarToken, doc: Mapping[str, Any], now: str
) -> Outcome:
    """The spec is fine; the operator is not set up to run it. Ready too, since the live timer
    (which owns Ready) skips a pool that is not accepted."""
    text = f"{owner.namespace}/{owner.name}: no pods rendered: {error}"
    reason = "SidecarTokenMissing"
    updates = [Condition(ACCEPTED, False, reason, text), Condition(READY, False, reason, text)]
    await patch_status(cluster, owner, status_patch(doc, updates, now))
    return Outcome(False, text)


async def reconcile(
    cluster: Cluster, settings: RenderSettings, doc: Mapping[str, Any], now: str | None = None
) -> Outcome:
    now = now or utc_now()
    owner = owner_of(doc)
    decision = await judge(doc, await neighbourhood(cluster, doc, earlier_only=True))
    if not decision.ok or decision.pool is None or decision.held is None:
        return await _refuse(cluster, owner, decision, doc, now)

    kind = await choose_workload(cluster, doc)
    try:
        rendered = render_pool(decision.pool, decision.held, owner, doc["spec"], settings, kind)
    except MissingSidecarToken as exc:
        return await _refuse_untokened(cluster, owner, exc, doc, now)
    secret = rendered.token_secret
    await cluster.create(secret)  # None when it is there already: immutable, so it is the same
    applied = [f"{secret['kind']}/{secret['metadata']['name']}"]
    for manifest in rendered.manifests:
        await cluster.apply(manifest)
        applied.append(f"{manifest['kind']}/{manifest['metadata']['name']}")
    await prune_config_maps(
        cluster, owner.namespace, owner.name, config_name(owner.name, rendered.config_hash)
    )
    held = decision.held
    text = (
        f"worst-case request {held.worst_request_pages} pages; the pool ({held.pages} pages) "
        f"holds {held.worst_concurrency} worst-case requests at once"
    )
    status = status_patch(
        doc,
        [Condition(ACCEPTED, True, "Holdable", text)],
        now,
        replicas=decision.pool.replicas,
        pages=held.pages,
        worstRequestPages=held.worst_request_pages,
        worstConcurrency=held.worst_concurrency,
        workload=kind.value,
        configHash=rendered.config_hash,
    )
    await patch_status(cluster, owner, status)
    return Outcome(True, text, tuple(applied))
