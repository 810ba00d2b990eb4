"""`spec.template`: where a pool's rank pods run and what they ask of their nodes, and the
chart's `pools.template` defaults it lays over, read as `kvbank.deployment` reads the
rest of the pod-facing fields (every problem a `FieldError` naming the field)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvbank.fields import FieldReader, SpecError

MAX_GPUS_PER_RANK = 16
MAX_ITEMS = 32
DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_KINDS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
SPREAD_FIELDS = {
    "maxSkew", "topologyKey", "whenUnsatisfiable", "labelSelector", "minDomains",
    "nodeAffinityPolicy", "nodeTaintsPolicy", "matchLabelKeys",
}  # fmt: skip
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
# spec.template.securityContext may only add to the hardening every rank pod gets
# (operator/render/security.py), never replace a field of it: groups to read a claim's files
# by, an SELinux type and level of those Pod Security restricted allows, an AppArmor profile.
SECURITY_ADDITIONS = ("supplementalGroups", "seLinuxOptions", "appArmorProfile")
OPERATOR_OWNED_SECURITY = (
    "the operator sets it on every rank pod (Pod Security restricted: uid 10001, non-root, no "
    "privilege escalation, every capability dropped, RuntimeDefault seccomp, a read-only root); "
    f"a pool may add only {', '.join(SECURITY_ADDITIONS)}"
)
SELINUX_TYPES = ("container_t", "container_init_t", "container_kvm_t", "container_engine_t")
APPARMOR_TYPES = ("RuntimeDefault", "Localhost")
MAX_GID = (1 << 31) - 1
TEMPLATE_FIELDS = {
    "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
    "runtimeClassName", "imagePullSecrets", "resources", "shmSize", "securityContext",
}  # fmt: skip


@dataclass(frozen=True)
class Resources:
    gpus_per_rank: int | None = None
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class SecurityAdditions:
    """What a pool adds to its pods' security context, in the pod spec's own words."""

    supplemental_groups: tuple[int, ...] = ()
    se_linux_options: Mapping[str, str] | None = None
    app_armor_profile: Mapping[str, str] | None = None


@dataclass(frozen=True)
class PodTemplate:
    """Every field None when not given, so a spec's template lays over the chart's defaults
    field by field (`over`)."""

    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] | None = None
    affinity: Mapping[str, Any] | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] | None = None
    resources: Resources = field(default_factory=Resources)
    shm_size: str | None = None
    security: SecurityAdditions | None = None

    def over(self, defaults: PodTemplate) -> PodTemplate:
        """This template, each unset field taken from `defaults` (resources field by field)."""
        chosen = {
            f.name: getattr(self, f.name)
            if getattr(self, f.name) is not None
            else getattr(defaults, f.name)
            for f in fields(self)
            if f.name != "resources"
        }
        mine, base = self.resources, defaults.resources
        resources = Resources(
            *(a if a is not None else b for a, b in zip(_values(mine), _values(base), strict=True))
        )
        return replace(self, **chosen, resources=resources)

    @property
    def gpus_per_rank(self) -> int:
        gpus = self.resources.gpus_per_rank
        return 1 if gpus is None else gpus


def _values(resources: Resources) -> tuple[Any, ...]:
    return tuple(getattr(resources, f.name) for f in fields(resources))


def read_name(r: FieldReader, obj: Mapping[str, Any], key: str, path: str, required: bool = True):
    value = r.string(obj, key, path, required=required)
    if value is not None and (len(value) > 253 or not DNS_NAME.match(value)):
        r.fail(f"{path}.{key}", f"must be a Kubernetes object name (lower-case, digits, '-', "
               f"'.'; at most 253), got {value[:80]!r}")  # fmt: skip
        return None
    return value


def read_quantity(r: FieldReader, obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not QUANTITY.match(text):
        r.fail(f"{path}.{key}", f"must be a Kubernetes quantity such as 500m, 8, 16Gi or 64Mi, "
               f"got {str(value)[:40]!r}")  # fmt: skip
        return None
    return text


def read_mapping_list(r: FieldReader, obj: Any, path: str) -> list[Mapping[str, Any]] | None:
    if obj is None:
        return None
    if not isinstance(obj, list) or len(obj) > MAX_ITEMS:
        r.fail(path, f"must be a list of at most {MAX_ITEMS} entries")
        return None
    items = [r.mapping(item, f"{path}[{i}]") for i, item in enumerate(obj)]
    return [i for i in items if i is not None] if None not in items else None


def _tolerations(r: FieldReader, obj: Any, path: str) -> tuple[Mapping[str, Any], ...] | None:
    items = read_mapping_list(r, obj, path)
    if items is None:
        return None
    for i, tol in enumerate(items):
        at = f"{path}[{i}]"
        r.unknown(tol, at, {"key", "operator", "value", "effect", "tolerationSeconds"})
        operator = r.string(tol, "operator", at, required=False, choices=TOLERATION_OPERATORS)
        r.string(tol, "effect", at, required=False, choices=TAINT_EFFECTS)
        if operator == "Exists" and tol.get("value"):
            r.fail(f"{at}.value", "must be empty with operator Exists; drop it or use Equal")
        if "tolerationSeconds" in tol:
            r.integer(tol, "tolerationSeconds", at, lo=0, hi=1 << 31)
            if tol.get("effect") != "NoExecute":
                r.fail(f"{at}.tolerationSeconds", "applies only with effect NoExecute")
    return tuple(items)


def _spread(r: FieldReader, obj: Any, path: str) -> tuple[Mapping[str, Any], ...] | None:
    items = read_mapping_list(r, obj, path)
    if items is None:
        return None
    for i, rule in enumerate(items):
        at = f"{path}[{i}]"
        r.unknown(rule, at, SPREAD_FIELDS)
        r.integer(rule, "maxSkew", at, lo=1, hi=1 << 20)
        r.string(rule, "topologyKey", at)
        r.string(rule, "whenUnsatisfiable", at, choices=WHEN_UNSATISFIABLE)
        if "labelSelector" in rule:
            r.mapping(rule["labelSelector"], f"{at}.labelSelector")
    return tuple(items)


def parse_template(obj: Any, path: str = "spec.template") -> PodTemplate:
    """A `spec.template` (or the chart's `pools.template` defaults). Raises SpecError."""
    r = FieldReader()
    template = read_template(r, obj, path)
    if r.errors:
        raise SpecError(r.errors)
    return template


def read_template(r: FieldReader, obj: Any, path: str) -> PodTemplate:
    t = r.mapping(obj, path, required=False)
    if t is None:
        return PodTemplate()
    r.unknown(t, path, TEMPLATE_FIELDS)
    selector = r.mapping(t.get("nodeSelector"), f"{path}.nodeSelector", required=False)
    if selector is not None:
        for key, value in selector.items():
            if not isinstance(key, str) or not key or len(key) > 317 or not isinstance(value, str):
                r.fail(f"{path}.nodeSelector", f"must map label keys to string values; "
                       f"{str(key)[:80]!r} does not")  # fmt: skip
    affinity = r.mapping(t.get("affinity"), f"{path}.affinity", required=False)
    if affinity is not None:
        r.unknown(affinity, f"{path}.affinity", AFFINITY_KINDS)
        for kind in AFFINITY_KINDS & set(affinity):
            r.mapping(affinity[kind], f"{path}.affinity.{kind}")
    pull = read_mapping_list(r, t.get("imagePullSecrets"), f"{path}.imagePullSecrets")
    pull_names = None
    if pull is not None:
        names = [
            read_name(r, p, "name", f"{path}.imagePullSecrets[{i}]") for i, p in enumerate(pull)
        ]
        pull_names = tuple(n for n in names if n)
    res = r.mapping(t.get("resources"), f"{path}.resources", required=False) or {}
    r.unknown(res, f"{path}.resources", {"gpusPerRank", "cpu", "memory"})
    gpus = None
    if "gpusPerRank" in res:
        gpus = r.integer(res, "gpusPerRank", f"{path}.resources", lo=0, hi=MAX_GPUS_PER_RANK)
    return PodTemplate(
        node_selector=dict(selector) if selector is not None else None,
        tolerations=_tolerations(r, t.get("tolerations"), f"{path}.tolerations"),
        affinity=dict(affinity) if affinity is not None else None,
        topology_spread_constraints=_spread(
            r, t.get("topologySpreadConstraints"), f"{path}.topologySpreadConstraints"
        ),
        priority_class_name=read_name(r, t, "priorityClassName", path, required=False),
        runtime_class_name=read_name(r, t, "runtimeClassName", path, required=False),
        image_pull_secrets=pull_names,
        resources=Resources(
            gpus,
            read_quantity(r, res, "cpu", f"{path}.resources"),
            read_quantity(r, res, "memory", f"{path}.resources"),
        ),
        shm_size=read_quantity(r, t, "shmSize", path),
        security=_security(r, t.get("securityContext"), f"{path}.securityContext"),
    )


def _security(r: FieldReader, obj: Any, path: str) -> SecurityAdditions | None:
    ctx = r.mapping(obj, path, required=False)
    if ctx is None:
        return None
    for key in ctx:
        if key not in SECURITY_ADDITIONS:
            r.fail(f"{path}.{key}", f"is not a field a pool sets: {OPERATOR_OWNED_SECURITY}")
    groups: list[int] = []
    raw_groups = ctx.get("supplementalGroups", [])
    if not isinstance(raw_groups, list) or len(raw_groups) > MAX_ITEMS:
        r.fail(f"{path}.supplementalGroups", f"must be a list of at most {MAX_ITEMS} group ids")
        raw_groups = []
    for i, gid in enumerate(raw_groups):
        if isinstance(gid, bool) or not isinstance(gid, int) or not 1 <= gid <= MAX_GID:
            # 0 is root's group: it would widen what the pod reads, not name a claim's owner.
            r.fail(f"{path}.supplementalGroups[{i}]", f"must be a group id from 1 to {MAX_GID} "
                   f"(0, root's group, is refused), got {str(gid)[:20]!r}")  # fmt: skip
        else:
            groups.append(gid)
    selinux = r.mapping(ctx.get("seLinuxOptions"), f"{path}.seLinuxOptions", required=False)
    if selinux is not None:
        r.unknown(selinux, f"{path}.seLinuxOptions", {"type", "level"})  # user, role: refused
        r.string(selinux, "type", f"{path}.seLinuxOptions", required=False, choices=SELINUX_TYPES)
        r.string(selinux, "level", f"{path}.seLinuxOptions", required=False)
    armor = r.mapping(ctx.get("appArmorProfile"), f"{path}.appArmorProfile", required=False)
    if armor is not None:
        at = f"{path}.appArmorProfile"
        r.unknown(armor, at, {"type", "localhostProfile"})
        kind = r.string(armor, "type", at, choices=APPARMOR_TYPES)
        if (kind == "Localhost") != ("localhostProfile" in armor):
            r.fail(f"{at}.localhostProfile", "is set exactly when type is Localhost")
    return SecurityAdditions(
        tuple(groups),
        dict(selinux) if selinux is not None else None,
        dict(armor) if armor is not None else None,
    )
