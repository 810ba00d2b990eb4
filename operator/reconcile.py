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

A pool whose architecture is `fromConfig.configMap` is judged on its config's layout, its status
shows the figures per KV group too, and it renders the config.json it was judged on into the
ranks' ConfigMap beside the manifest, whose fromConfig then names that copy: the engine and the
sidecar resolve the same layout `kvbank check` would (`kvbank.operator.model_config`). An edit
of the config's ConfigMap is judged again (the handlers watch the ConfigMaps pools name); if the
new config is refused, the pods keep the copy last accepted and the Accepted condition says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvbank.capacity import holdability
from kvbank.capacity.configured import ConfigSourceError
from kvbank.deployment import Deployment, parse_deployment
from kvbank.modelpool import KIND, ModelPool, SpecError, parse_modelpool
from kvbank.operator.admission import Decision, judge, message, neighbourhood
from kvbank.operator.certs import CertBundle
from kvbank.operator.cluster import (
    KVBANK,
    Cluster,
    KubeConflict,
    KubeError,
    KubeUnavailable,
    identity,
)
from kvbank.operator.model_config import (
    config_map_of,
    configured,
    pinned,
    read_model_config,
    served_spec,
    served_text,
)
from kvbank.operator.pool_tls import ensure_pool_tls
from kvbank.operator.pruning import prune_config_maps, prune_picker
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import (
    LWS_API_VERSION,
    Owner,
    RenderSettings,
    Workload,
    config_name,
    selector_labels,
)
from kvbank.operator.render.status import ACCEPTED, READY, Condition, conditions, status_patch
from kvbank.operator.render.token import MissingSidecarToken, token_secret
from kvbank.operator.render.workloads import workload_refusal
from kvbank.operator.repair import stored_differs, why_repair
from kvbank.operator.routing_status import routable, without_routing
from kvbank.operator.verdicts import Accepted, recall, remember
from kvbank.operator.weights_status import WEIGHTS, source_condition

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc_now() -> str:
    return datetime.now(UTC).strftime(TIME_FORMAT)


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
    """Accepted=False with every violation; nothing rendered, nothing running touched. A
    fromConfig pool's pods, if any run, are told to keep the config.json last accepted: its
    ConfigMap can change under an unchanged spec."""
    text = message(owner.namespace, owner.name, decision)
    rendered = (doc.get("status") or {}).get("configHash")
    if decision.pool is not None and decision.pool.from_config is not None and rendered:
        text += (
            f"\nThe running pods keep the spec and config.json last accepted (ConfigMap "
            f"{config_name(owner.name, str(rendered))}) until this is fixed."
        )
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


def _moment(now: str) -> datetime:
    return datetime.strptime(now, TIME_FORMAT).replace(tzinfo=UTC)


def pod_selector(pool: str) -> str:
    """status.selector, the scale subresource's labelSelectorPath: every rank pod of the pool."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(pool).items())


async def _refuse_render(
    cluster: Cluster, owner: Owner, error: KubeError, what: str, doc: Mapping[str, Any], now: str
) -> Outcome:
    """The apiserver refused a rendered object (an affinity it cannot read, say): the spec
    passed every rule the operator can check, so the apiserver's words are the message."""
    text = (
        f"{owner.namespace}/{owner.name}: the apiserver refused the rendered {what}: {error}. "
        "Fix the spec.template field it names."
    )
    update = Condition(ACCEPTED, False, "RenderRefused", text)
    await patch_status(cluster, owner, status_patch(doc, [update], now))
    return Outcome(False, text)


async def _refuse_workload(
    cluster: Cluster, owner: Owner, why: str, doc: Mapping[str, Any], now: str
) -> Outcome:
    """The spec is holdable, but not by the workload kind this cluster gives it; what already
    runs is left alone."""
    text = f"{owner.namespace}/{owner.name}: no pods rendered: {why}"
    update = Condition(ACCEPTED, False, "NeedsLeaderWorkerSet", text)
    await patch_status(cluster, owner, status_patch(doc, [update], now))
    return Outcome(False, text)


async def converge(
    cluster: Cluster,
    settings: RenderSettings,
    doc: Mapping[str, Any],
    accepted: Accepted,
    now: str,
    *,
    issuer: CertBundle | None = None,
    repair_only: bool = False,
) -> Outcome:
    """Render the pool and bring the cluster to it: every object applied (reconcile), or only
    those missing or drifted (`repair_only`, the timer). Then the status."""
    owner = owner_of(doc)
    status_now = doc.get("status") or {}
    try:  # before anything is made for pods that could not start
        token_secret(owner, settings.sidecar_token)
    except MissingSidecarToken as exc:
        return await _refuse_untokened(cluster, owner, exc, doc, now)
    refusal = workload_refusal(accepted.pool, accepted.deployment, accepted.kind)
    if refusal is not None:
        return await _refuse_workload(cluster, owner, refusal, doc, now)
    tls, tls_record = await ensure_pool_tls(cluster, owner, status_now, issuer, _moment(now))
    spec = doc["spec"] if accepted.model_config is None else served_spec(doc["spec"])
    rendered = render_pool(
        accepted.pool,
        accepted.held,
        owner,
        spec,
        settings,
        accepted.kind,
        accepted.deployment,
        tls,
        accepted.model_config,
    )
    secret = rendered.token_secret
    restored = await cluster.create(secret) is not None and repair_only
    applied = (
        [f"{secret['kind']}/{secret['metadata']['name']}"] if not repair_only or restored else []
    )
    manifests, routing = await routable(cluster, owner, accepted.deployment, rendered.manifests)
    for manifest in manifests:
        what = f"{manifest['kind']}/{manifest['metadata']['name']}"
        if repair_only:
            api_version, kind, namespace, name = identity(manifest)
            live = await cluster.get(api_version, kind, name, namespace)
            why = why_repair(manifest, live)
            if why is None:
                continue
            if live is not None and not stored_differs(
                await cluster.apply(manifest, dry_run=True), live
            ):
                continue  # the apiserver stores what is rendered in its own words: no drift
            what += f" ({why})"
        try:
            await cluster.apply(manifest)
        except (KubeUnavailable, KubeConflict):
            raise
        except KubeError as exc:
            if exc.status not in (400, 422):
                raise
            return await _refuse_render(cluster, owner, exc, what, doc, now)
        applied.append(what)
    await prune_config_maps(
        cluster, owner.namespace, owner.name, config_name(owner.name, rendered.config_hash)
    )
    if not repair_only:  # what a pool no longer renders goes at the reconcile that stops it
        await prune_picker(cluster, owner, accepted.deployment.picker)
    held, generation = accepted.held, int(doc["metadata"].get("generation") or 0)
    text = (
        f"worst-case request {held.worst_request_pages} pages; the pool ({held.pages} pages) "
        f"holds {held.worst_concurrency} worst-case requests at once"
    )
    weights = await source_condition(cluster, owner.namespace, accepted.deployment)
    updates = [Condition(ACCEPTED, True, "Holdable", text)]
    if routing is not None:
        updates.append(routing)
    current = status_now.get("conditions") if routing is not None else without_routing(status_now)
    if not (weights.status and _failed_check(current)):
        updates.append(weights)  # a failed check in the pods outranks a bound claim
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": accepted.pool.replicas,
        "selector": pod_selector(owner.name),
        "pages": held.pages,
        "worstRequestPages": held.worst_request_pages,
        "worstConcurrency": held.worst_concurrency,
        "workload": accepted.kind.value,
        "configHash": rendered.config_hash,
        "conditions": conditions(current, updates, generation, now),
    }
    if tls_record is not None:
        status["sidecarTLS"] = tls_record
    if accepted.groups:
        status["groups"] = [group.status() for group in accepted.groups]
    elif "groups" in status_now:  # a fromConfig pool's, from before its spec named kvSlots
        status["groups"] = None  # a merge patch's null drops it
    if repair_only and _unchanged(status_now, status):
        return Outcome(True, text, tuple(applied))
    await patch_status(cluster, owner, status)
    return Outcome(True, text, tuple(applied))


def _failed_check(current: Any) -> bool:
    for cond in current or ():
        if isinstance(cond, Mapping) and cond.get("type") == WEIGHTS:
            return cond.get("reason") == "WeightsCheckFailed" and cond.get("status") == "False"
    return False


def _unchanged(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """The repair timer writes status only when something in it moved."""
    return all(before.get(k) == v for k, v in after.items())


async def reconcile(
    cluster: Cluster,
    settings: RenderSettings,
    doc: Mapping[str, Any],
    now: str | None = None,
    issuer: CertBundle | None = None,
) -> Outcome:
    now = now or utc_now()
    owner = owner_of(doc)
    around = await neighbourhood(
        cluster, doc, earlier_only=True, defaults=settings.template_defaults
    )
    decision = await judge(doc, around)
    if (
        not decision.ok
        or decision.pool is None
        or decision.held is None
        or decision.deployment is None
    ):
        return await _refuse(cluster, owner, decision, doc, now)
    kind = await choose_workload(cluster, doc)
    pool, text = decision.pool, None
    if decision.layout is not None and around.model_config is not None:
        pool = pinned(pool, decision.layout, decision.held.pages)
        text = served_text(around.model_config)
    remember(doc, text, (decision.held, decision.groups))
    accepted = Accepted(pool, decision.held, decision.deployment, kind, text, decision.groups)
    return await converge(cluster, settings, doc, accepted, now, issuer=issuer)


async def rejudge(
    cluster: Cluster,
    settings: RenderSettings,
    namespace: str,
    config_map: str,
    pools: Iterable[str],
    issuer: CertBundle | None = None,
) -> list[Outcome]:
    """ConfigMap `namespace/config_map` changed (or came or went): each of `pools` that still
    takes its config.json from it is judged again as on a spec change. A config now refused
    leaves Accepted=False naming the field, and the pods running on the copy last accepted;
    one accepted renders its copy, which rolls the pods onto it."""
    outcomes = []
    for name in sorted(set(pools)):
        doc = await cluster.get(KVBANK, KIND, name, namespace)
        if doc is None or config_map_of(doc) != (namespace, config_map):
            continue  # deleted, or its spec moved on since it was indexed
        outcomes.append(await reconcile(cluster, settings, doc, issuer=issuer))
    return outcomes


def _accepted_generation(doc: Mapping[str, Any]) -> bool:
    generation = int(doc["metadata"].get("generation") or 0)
    for cond in (doc.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == ACCEPTED:
            return cond.get("status") == "True" and cond.get("observedGeneration") == generation
    return False


async def repair(
    cluster: Cluster,
    settings: RenderSettings,
    doc: Mapping[str, Any],
    now: str | None = None,
    issuer: CertBundle | None = None,
) -> Outcome | None:
    """Restore what an accepted pool renders; None for a pool not accepted at its current
    generation (reconcile owns that one: it may be refused, or being judged now)."""
    if not _accepted_generation(doc):
        return None
    try:
        pool, deployment = parse_modelpool(doc), parse_deployment(doc)
    except SpecError:
        return None
    now = now or utc_now()
    if pool.from_config is not None:
        return await _repair_configured(cluster, settings, doc, pool, deployment, now, issuer)
    judged = recall(doc, None)
    if judged is None:
        judged = await asyncio.to_thread(holdability, pool), ()
        remember(doc, None, judged)
    held = judged[0]
    kind = await choose_workload(cluster, doc)
    accepted = Accepted(pool, held, deployment, kind)
    return await converge(cluster, settings, doc, accepted, now, issuer=issuer, repair_only=True)


async def _repair_configured(
    cluster: Cluster,
    settings: RenderSettings,
    doc: Mapping[str, Any],
    pool: ModelPool,
    deployment: Deployment,
    now: str,
    issuer: CertBundle | None,
) -> Outcome:
    """A fromConfig pool's repair renders the config.json reconcile judged, read again. One
    this process has not judged at this generation (edited while no watch event reached the
    operator, or after a restart) is judged again in full: reconcile renders it or refuses."""
    found = await read_model_config(cluster, doc)
    try:
        layout = configured(pool, found)
    except ConfigSourceError:
        return await reconcile(cluster, settings, doc, now, issuer)
    assert found is not None and layout is not None
    text = served_text(found)
    judged = recall(doc, text)
    if judged is None:
        return await reconcile(cluster, settings, doc, now, issuer)
    held, groups = judged
    kind = await choose_workload(cluster, doc)
    accepted = Accepted(pinned(pool, layout, held.pages), held, deployment, kind, text, groups)
    return await converge(cluster, settings, doc, accepted, now, issuer=issuer, repair_only=True)
