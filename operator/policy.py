"""CapacityPolicy: a platform team's limits, read the way Kueue's ClusterQueue quotas read — a
namespace selector and the limits that apply to every namespace it selects.

A namespace selected by several policies gets every limit of every one of them: the most
restrictive wins, and each violation names the policy that set it, so nothing depends on the
order policies were listed in. Pure functions over parsed objects; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbank.fields import FieldReader, SpecError, check_size, key_path, quote
from kvbank.modelpool import (
    API_GROUP,
    API_VERSION,
    MAX_PAGE_SIZE,
    MAX_PAGES,
    MAX_SEQ_LEN,
    ModelPool,
)

POLICY_KIND = "CapacityPolicy"
MAX_GPUS = 1 << 20
MAX_SELECTOR_TERMS = 16
MAX_SELECTOR_VALUES = 32
MAX_PAGE_SIZES = 16
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
LIMIT_FIELDS = (
    "gpusPerNamespace",
    "pagesPerPool",
    "maxTokens",
    "maxSeqLen",
    "allowedPageSizes",
    "minConcurrency",
)


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = self.key in labels and labels[self.key] in self.values
        return inside if self.operator == "In" else not inside


@dataclass(frozen=True)
class NamespaceSelector:
    """Kubernetes label-selector semantics: every term must hold; an empty selector selects
    every namespace."""

    match_labels: Mapping[str, str]
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )


@dataclass(frozen=True)
class PolicyLimits:
    gpus_per_namespace: int | None = None  # sum over pools of replicas x tensorParallel
    pages_per_pool: int | None = None  # kv pages per rank
    max_tokens: int | None = None
    max_seq_len: int | None = None
    allowed_page_sizes: tuple[int, ...] | None = None
    min_concurrency: int | None = None  # a floor on admission.minConcurrency


@dataclass(frozen=True)
class CapacityPolicy:
    name: str
    # None selects no namespace (as Kueue's nil namespaceSelector); {} selects every one.
    selector: NamespaceSelector | None
    limits: PolicyLimits


@dataclass(frozen=True)
class PoolUsage:
    """What another pool in the same namespace already takes from the quota."""

    name: str
    gpus: int


def gpus(pool: ModelPool) -> int:
    return pool.replicas * pool.tensor_parallel


def _selector(r: FieldReader, obj: Any) -> NamespaceSelector | None:
    path = "spec.namespaceSelector"
    if obj is None:
        return None
    sel = r.mapping(obj, path)
    if sel is None:
        return None
    r.unknown(sel, path, {"matchLabels", "matchExpressions"})
    labels = r.mapping(sel.get("matchLabels"), f"{path}.matchLabels", required=False) or {}
    for key, value in labels.items():
        if not isinstance(value, str):
            r.fail(key_path(f"{path}.matchLabels", key), f"must be a string, got {quote(value)}")
    exprs_obj = sel.get("matchExpressions") or []
    if not isinstance(exprs_obj, list) or len(exprs_obj) > MAX_SELECTOR_TERMS:
        r.fail(f"{path}.matchExpressions", f"must be a list of at most {MAX_SELECTOR_TERMS}")
        exprs_obj = []
    exprs: list[Requirement] = []
    for index, item in enumerate(exprs_obj):
        epath = f"{path}.matchExpressions[{index}]"
        expr = r.mapping(item, epath)
        if expr is None:
            continue
        r.unknown(expr, epath, {"key", "operator", "values"})
        label_key = r.string(expr, "key", epath)
        op = r.string(expr, "operator", epath, choices=OPERATORS)
        values = expr.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            r.fail(f"{epath}.values", "must be a list of strings")
            continue
        if op in ("In", "NotIn") and not values:
            r.fail(f"{epath}.values", f"must not be empty with operator {op}")
        if op in ("Exists", "DoesNotExist") and values:
            r.fail(f"{epath}.values", f"must be empty with operator {op}")
        if label_key and op:
            exprs.append(Requirement(label_key, op, tuple(values)))
    return NamespaceSelector(
        {str(k): str(v) for k, v in labels.items() if isinstance(v, str)}, tuple(exprs)
    )


def parse_capacity_policy(doc: Any) -> CapacityPolicy:
    """Read a CapacityPolicy manifest. Raises SpecError listing every problem."""
    too_big = check_size(doc)
    if too_big is not None:
        raise SpecError([too_big])
    r = FieldReader()
    top = r.mapping(doc, "manifest")
    if top is None:
        raise SpecError(r.errors)
    if top.get("apiVersion") != f"{API_GROUP}/{API_VERSION}":
        sent = quote(top.get("apiVersion"))
        r.fail("apiVersion", f"must be {API_GROUP}/{API_VERSION}, got {sent}")
    if top.get("kind") != POLICY_KIND:
        r.fail("kind", f"must be {POLICY_KIND}, got {quote(top.get('kind'))}")
    meta = r.mapping(top.get("metadata"), "metadata") or {}
    name = r.string(meta, "name", "metadata") or ""
    spec = r.mapping(top.get("spec"), "spec")
    if spec is None:
        raise SpecError(r.errors)
    r.unknown(spec, "spec", {"namespaceSelector", "limits"})
    selector = _selector(r, spec.get("namespaceSelector"))
    lim = r.mapping(spec.get("limits"), "spec.limits") or {}
    r.unknown(lim, "spec.limits", set(LIMIT_FIELDS))
    path = "spec.limits"

    def optional(key: str, lo: int, hi: int) -> int | None:
        return r.integer(lim, key, path, lo=lo, hi=hi) if key in lim else None

    sizes_obj = lim.get("allowedPageSizes")
    sizes: tuple[int, ...] | None = None
    if sizes_obj is not None:
        ok = isinstance(sizes_obj, list) and 1 <= len(sizes_obj) <= MAX_PAGE_SIZES
        ok = ok and all(
            isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_PAGE_SIZE
            for s in sizes_obj
        )
        if ok:
            sizes = tuple(sorted(set(sizes_obj)))
        else:
            r.fail(
                f"{path}.allowedPageSizes",
                f"must list 1 to {MAX_PAGE_SIZES} page sizes from 1 to {MAX_PAGE_SIZE}, "
                f"got {quote(sizes_obj)}",
            )
    limits = PolicyLimits(
        gpus_per_namespace=optional("gpusPerNamespace", 0, MAX_GPUS),
        pages_per_pool=optional("pagesPerPool", 2, MAX_PAGES),
        max_tokens=optional("maxTokens", 1, MAX_SEQ_LEN),
        max_seq_len=optional("maxSeqLen", 2, MAX_SEQ_LEN),
        allowed_page_sizes=sizes,
        min_concurrency=optional("minConcurrency", 0, MAX_PAGES),
    )
    if r.errors:
        raise SpecError(r.errors)
    return CapacityPolicy(name, selector, limits)


def matching(
    policies: Iterable[CapacityPolicy], namespace_labels: Mapping[str, str]
) -> list[CapacityPolicy]:
    return [p for p in policies if p.selector is not None and p.selector.matches(namespace_labels)]


def policy_violations(
    pool: ModelPool,
    pages: int,
    policies: Sequence[CapacityPolicy],
    others: Sequence[PoolUsage],
) -> list[str]:
    """Every limit of every given (already matched) policy the pool breaks, each naming the
    policy, the numbers and what to change. `pages` is the pool's resolved pages per rank and
    `others` the namespace's other pools that count against its GPU quota."""
    problems: list[str] = []
    for policy in sorted(policies, key=lambda p: p.name):
        lim, who = policy.limits, f"CapacityPolicy {policy.name}"
        if lim.gpus_per_namespace is not None:
            used = sum(o.gpus for o in others)
            total = used + gpus(pool)
            if total > lim.gpus_per_namespace:
                room = max(0, lim.gpus_per_namespace - used)
                parts = [f"{o.name} {o.gpus}" for o in sorted(others, key=lambda o: o.name)]
                parts.append(
                    f"{pool.name} {gpus(pool)} = replicas {pool.replicas} x tensorParallel "
                    f"{pool.tensor_parallel}"
                )
                problems.append(
                    f"{who}: namespace {pool.namespace} would use {total} GPUs ("
                    + ", ".join(parts)
                    + f") but gpusPerNamespace is {lim.gpus_per_namespace}. Lower replicas to "
                    f"at most {room // pool.tensor_parallel}, or free GPUs in the namespace's "
                    "other pools."
                )
        if lim.pages_per_pool is not None and pages > lim.pages_per_pool:
            field = "kv.pages" if pool.kv.pages is not None else "kv.memoryFraction"
            problems.append(
                f"{who}: the pool has {pages} pages per rank but pagesPerPool is "
                f"{lim.pages_per_pool}. Lower {field} so the pool has at most "
                f"{lim.pages_per_pool} pages."
            )
        if lim.max_tokens is not None and pool.limits.max_tokens > lim.max_tokens:
            problems.append(
                f"{who}: limits.maxTokens={pool.limits.max_tokens} is above the policy's "
                f"maxTokens {lim.max_tokens}. Lower limits.maxTokens to at most {lim.max_tokens}."
            )
        if lim.max_seq_len is not None and pool.limits.max_seq_len > lim.max_seq_len:
            problems.append(
                f"{who}: limits.maxSeqLen={pool.limits.max_seq_len} is above the policy's "
                f"maxSeqLen {lim.max_seq_len}. Lower limits.maxSeqLen to at most "
                f"{lim.max_seq_len}."
            )
        sizes = lim.allowed_page_sizes
        if sizes is not None and pool.kv.page_size not in sizes:
            problems.append(
                f"{who}: kv.pageSize={pool.kv.page_size} is not allowed. Use one of "
                + ", ".join(str(s) for s in sizes)
                + "."
            )
        floor = lim.min_concurrency
        if floor is not None and pool.admission.min_concurrency < floor:
            problems.append(
                f"{who}: admission.minConcurrency={pool.admission.min_concurrency} is below the "
                f"policy's floor {floor}. Raise admission.minConcurrency to at least {floor} "
                "(and kv.pages to hold them)."
            )
    return problems
