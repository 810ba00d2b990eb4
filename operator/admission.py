"""Whether a ModelPool may exist: the foundation's holdability rules plus every CapacityPolicy
that selects its namespace. The webhook and reconcile both call `decide`, so a spec that slipped
past the webhook (it was down, or two applies raced a quota) is judged by the same rules.

Violation lines are the ones `kvbank check` prints: the parser's field errors and
`holdability(pool).violations` verbatim, then the policy's. A `fromConfig` pool is judged on
the layout of the config.json its ConfigMap holds (`kvbank.operator.model_config`, read with
the rest of the neighbourhood), by the same `holdability` as `kvbank check` judges a file, and
refused where the engine it names would not run that layout (`serving_refusals`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbank.capacity import Holdability, holdability
from kvbank.capacity.configured import ConfigSourceError, ConfiguredModel
from kvbank.deployment import Deployment, HostPathSource, PodTemplate, parse_deployment
from kvbank.modelpool import KIND, ModelPool, SpecError, parse_modelpool
from kvbank.operator.cluster import KVBANK, Cluster
from kvbank.operator.model_config import (
    KvGroupFigures,
    ModelConfig,
    configured,
    group_figures,
    read_model_config,
    serving_refusals,
)
from kvbank.operator.policy import (
    CapacityPolicy,
    PoolUsage,
    gpus,
    matching,
    parse_capacity_policy,
    policy_violations,
)

log = logging.getLogger(__name__)
NO_DEFAULTS = PodTemplate()
REVIEW_TIMEOUT = 8.0  # seconds; the apiserver gives a webhook 10 by default


@dataclass(frozen=True)
class Decision:
    pool: ModelPool | None
    held: Holdability | None
    violations: tuple[str, ...]
    reason: str  # a CamelCase reason for the Accepted condition
    deployment: Deployment | None = None
    warnings: tuple[str, ...] = ()  # admitted, but the user should know (kubectl prints them)
    # A fromConfig pool's KV groups as its config.json lays them out (status.groups); empty for
    # a pool described by hand.
    groups: tuple[KvGroupFigures, ...] = ()
    # A fromConfig pool's layout, as judged; None for a pool described by hand.
    layout: ConfiguredModel | None = None

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True)
class Neighbourhood:
    """What the policy needs besides the pool: its namespace's labels, the policies, and the
    namespace's other pools that count against the GPU quota."""

    namespace_labels: Mapping[str, str]
    policies: Sequence[CapacityPolicy]
    others: Sequence[PoolUsage]
    # The chart's pools.template: a pool that sets no gpusPerRank gets its default.
    defaults: PodTemplate = NO_DEFAULTS
    # The config.json a fromConfig pool's ConfigMap holds (or why it holds none).
    model_config: ModelConfig | None = None


def gpus_per_rank(deployment: Deployment, defaults: PodTemplate) -> int:
    return deployment.template.over(defaults).gpus_per_rank


def _parse(doc: Mapping[str, Any]) -> tuple[ModelPool | None, Deployment | None, list[str]]:
    """Both readers' errors at once, so one apply shows every problem."""
    errors: list[str] = []
    pool = deployment = None
    try:
        pool = parse_modelpool(doc)
    except SpecError as exc:
        errors += [str(e) for e in exc.errors]
    try:
        deployment = parse_deployment(doc)
    except SpecError as exc:
        errors += [str(e) for e in exc.errors]
    return pool, deployment, errors


def dev_warnings(deployment: Deployment) -> tuple[str, ...]:
    if isinstance(deployment.source, HostPathSource):
        return (
            f"spec.model.source.hostPath ({deployment.source.path}) is for development only: "
            "every node must have it, and Pod Security baseline and restricted refuse it. "
            "Use spec.model.source.pvc in production.",
        )
    return ()


def decide(doc: Mapping[str, Any], around: Neighbourhood) -> Decision:
    pool, deployment, errors = _parse(doc)
    if pool is None or deployment is None:
        return Decision(None, None, tuple(errors), "InvalidSpec")
    try:
        layout = configured(pool, around.model_config)
    except ConfigSourceError as exc:
        return Decision(pool, None, (str(exc),), "InvalidConfig", deployment)
    held = holdability(pool, layout)
    over = policy_violations(
        pool,
        held.pages,
        matching(around.policies, around.namespace_labels),
        around.others,
        gpus_per_rank(deployment, around.defaults),
    )
    unserved = serving_refusals(layout, deployment) if layout is not None else ()
    reason = (
        "Unholdable"
        if not held.ok
        else "OverPolicy"
        if over
        else "UnservableLayout"
        if unserved
        else "Holdable"
    )
    warnings = dev_warnings(deployment)
    return Decision(
        pool,
        held,
        (*held.violations, *over, *unserved),
        reason,
        deployment,
        warnings,
        group_figures(pool, layout) if layout is not None else (),
        layout,
    )


def message(namespace: str, name: str, decision: Decision) -> str:
    count = len(decision.violations)
    lines = "".join(f"\n  - {v}" for v in decision.violations)
    return f"{KIND} {namespace}/{name}: {count} violation(s):{lines}"


def _accepted_false(doc: Mapping[str, Any]) -> bool:
    for cond in (doc.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Accepted":
            return cond.get("status") == "False"
    return False


def _created_key(doc: Mapping[str, Any]) -> tuple[str, str]:
    meta = doc.get("metadata") or {}
    return str(meta.get("creationTimestamp") or "~"), str(meta.get("name") or "")


def usage(
    docs: Sequence[Mapping[str, Any]],
    name: str,
    before: tuple[str, str] | None,
    defaults: PodTemplate = NO_DEFAULTS,
) -> list[PoolUsage]:
    """The namespace's other pools that hold GPUs: not this one, not one refused, and — when
    `before` is given (reconcile) — only those created earlier, so of two pools that raced a
    quota the later one is refused and the earlier one keeps its GPUs, whichever reconciles
    first. The webhook passes None: a pool being applied comes after all that exist."""
    result = []
    for doc in docs:
        meta = doc.get("metadata") or {}
        if meta.get("name") == name or _accepted_false(doc):
            continue
        if before is not None and _created_key(doc) >= before:
            continue
        pool, deployment, _ = _parse(doc)
        if pool is None or deployment is None:
            continue  # a malformed pool renders nothing, so it holds no GPUs
        result.append(PoolUsage(pool.name, gpus(pool, gpus_per_rank(deployment, defaults))))
    return result


async def neighbourhood(
    cluster: Cluster,
    doc: Mapping[str, Any],
    *,
    earlier_only: bool,
    defaults: PodTemplate = NO_DEFAULTS,
) -> Neighbourhood:
    meta = doc.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    ns = await cluster.get("v1", "Namespace", namespace)
    labels = dict(((ns or {}).get("metadata") or {}).get("labels") or {})
    labels.setdefault("kubernetes.io/metadata.name", namespace)
    policies = []
    for policy_doc in await cluster.list(KVBANK, "CapacityPolicy"):
        try:
            policies.append(parse_capacity_policy(policy_doc))
        except SpecError as exc:
            # Stored before the webhook existed; refusing every pool over it would be worse.
            log.warning("ignoring malformed CapacityPolicy: %s", exc)
    pools = await cluster.list(KVBANK, KIND, namespace)
    before = _created_key(doc) if earlier_only else None
    model_config = await read_model_config(cluster, doc)
    return Neighbourhood(
        labels, policies, usage(pools, name, before, defaults), defaults, model_config
    )


def spec_changed(doc: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    return old is None or old.get("spec") != doc.get("spec")


async def judge(doc: Mapping[str, Any], around: Neighbourhood) -> Decision:
    """`decide` in a worker thread: the worst-case search grows with maxSeqLen x the slots'
    multipliers / pageSize, which the schema's bounds still let reach seconds, and the event
    loop must keep serving other reviews, timers and watches meanwhile."""
    return await asyncio.to_thread(decide, doc, around)


async def review(
    cluster: Cluster,
    doc: Mapping[str, Any],
    old: Mapping[str, Any] | None,
    timeout: float = REVIEW_TIMEOUT,
    *,
    defaults: PodTemplate = NO_DEFAULTS,
    warnings: list[str] | None = None,
) -> str | None:
    """The webhook's answer: None to admit, else the message for kubectl. An update that leaves
    the spec alone (labels, finalizers, the operator's own annotations) is admitted unjudged,
    so a pool that slipped past can still be relabelled or deleted. A spec that cannot be
    judged within `timeout` (below the apiserver's 10 s webhook timeout) is refused, saying why.
    What an admitted spec should still be told (a development-only source) goes to
    `warnings`, which kubectl prints."""
    if not spec_changed(doc, old):
        return None
    meta = doc.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
    around = await neighbourhood(cluster, doc, earlier_only=False, defaults=defaults)
    try:
        decision = await asyncio.wait_for(judge(doc, around), timeout)
    except TimeoutError:
        return (
            f"{KIND} {namespace}/{name}: could not be judged within {timeout:g} s: the "
            "worst-case request search grows with limits.maxSeqLen x the kvSlots multipliers / "
            "kv.pageSize. Raise kv.pageSize or lower limits.maxSeqLen."
        )
    if decision.ok:
        if warnings is not None:
            warnings.extend(decision.warnings)
        return None
    return message(namespace, name, decision)


async def review_scale(
    cluster: Cluster,
    namespace: str,
    name: str,
    replicas: int,
    *,
    defaults: PodTemplate = NO_DEFAULTS,
    timeout: float = REVIEW_TIMEOUT,
) -> str | None:
    """`kubectl scale modelpool NAME --replicas N`: the apiserver sends the Scale, not the
    pool, so the pool is read and judged with its new replica count — the GPU quota is what a
    scale can break."""
    current = await cluster.get(KVBANK, KIND, name, namespace)
    if current is None:
        return None  # the apiserver answers 404 itself
    scaled = {**current, "spec": {**(current.get("spec") or {}), "replicas": replicas}}
    return await review(cluster, scaled, current, timeout, defaults=defaults)


def review_policy(doc: Mapping[str, Any]) -> str | None:
    try:
        parse_capacity_policy(doc)
    except SpecError as exc:
        name = (doc.get("metadata") or {}).get("name")
        lines = "".join(f"\n  - {e}" for e in exc.errors)
        return f"CapacityPolicy {name}: {len(exc.errors)} violation(s):{lines}"
    return None
