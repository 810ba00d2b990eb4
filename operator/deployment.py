"""The pod-facing parts of a ModelPool spec, which the operator alone reads: where the weights
come from (`spec.model.source`), where and how big the pods are (`spec.template`), which engine
runs (`spec.engine`) and the Secret holding its API keys (`spec.apiKeySecret`).

`kvbank.modelpool` accepts these keys and leaves them to this module, so the engine and the
sidecar, which read the same manifest, need nothing of Kubernetes. Like it, parsing collects
every problem as a `FieldError` naming the field and what to write instead. What Kubernetes
itself validates deeply (the inside of an affinity) is checked here only for shape; the
apiserver judges the rest when the StatefulSet is applied, and reconcile reports its answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvbank.fields import FieldReader, SpecError

ENGINE_KINDS = ("kvbank", "vllm")
SOURCE_KINDS = ("pvc", "hostPath", "image", "huggingFace")
DEFAULT_API_KEY = "api-key"
DEFAULT_IMAGE_PATH = "/models"
MAX_GPUS_PER_RANK = 16
MAX_ENGINE_ARGS = 64
MAX_ARG_LENGTH = 256
MAX_ITEMS = 32
# The flags each engine gets from the spec; setting one in spec.engine.args would contradict
# the figures the webhook judged.
RENDERED_FLAGS = {
    "kvbank": (
        "--host", "--port", "--sidecar", "--sidecar-token-file", "--sidecar-ca-file", "--model",
        "--pages", "--page-size", "--max-seq-len", "--max-tokens", "--policy", "--api-key-file",
    ),
    "vllm": (
        "--port", "--scheduler-cls", "--block-size", "--num-gpu-blocks-override",
        "--max-model-len", "--tensor-parallel-size", "--api-key",
    ),
}  # fmt: skip

DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
HF_REPO = re.compile(r"^[A-Za-z0-9][-\w.]*(/[-\w.]+)?$")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_KINDS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
SPREAD_FIELDS = {
    "maxSkew", "topologyKey", "whenUnsatisfiable", "labelSelector", "minDomains",
    "nodeAffinityPolicy", "nodeTaintsPolicy", "matchLabelKeys",
}  # fmt: skip
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
TEMPLATE_FIELDS = {
    "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
    "runtimeClassName", "imagePullSecrets", "resources", "shmSize",
}  # fmt: skip


@dataclass(frozen=True)
class SecretKey:
    name: str
    key: str


@dataclass(frozen=True)
class PvcSource:
    claim_name: str
    sub_path: str | None = None


@dataclass(frozen=True)
class HostPathSource:
    path: str


@dataclass(frozen=True)
class ImageSource:
    reference: str
    path: str = DEFAULT_IMAGE_PATH  # where the image holds the model folder


@dataclass(frozen=True)
class HuggingFaceSource:
    repo: str
    revision: str | None = None
    token: SecretKey | None = None


Source = PvcSource | HostPathSource | ImageSource | HuggingFaceSource


@dataclass(frozen=True)
class Resources:
    gpus_per_rank: int | None = None
    cpu: str | None = None
    memory: str | None = None


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


@dataclass(frozen=True)
class Engine:
    kind: str = "kvbank"
    image: str | None = None
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Deployment:
    source: Source | None = None
    template: PodTemplate = field(default_factory=PodTemplate)
    engine: Engine = field(default_factory=Engine)
    api_key: SecretKey | None = None


# ---- field readers ----------------------------------------------------------------------


def _name(r: FieldReader, obj: Mapping[str, Any], key: str, path: str, required: bool = True):
    value = r.string(obj, key, path, required=required)
    if value is not None and (len(value) > 253 or not DNS_NAME.match(value)):
        r.fail(f"{path}.{key}", f"must be a Kubernetes object name (lower-case, digits, '-', "
               f"'.'; at most 253), got {value[:80]!r}")  # fmt: skip
        return None
    return value


def _quantity(r: FieldReader, obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not QUANTITY.match(text):
        r.fail(f"{path}.{key}", f"must be a Kubernetes quantity such as 500m, 8, 16Gi or 64Mi, "
               f"got {str(value)[:40]!r}")  # fmt: skip
        return None
    return text


def _secret_key(
    r: FieldReader, obj: Any, path: str, default_key: str | None = None
) -> SecretKey | None:
    ref = r.mapping(obj, path)
    if ref is None:
        return None
    r.unknown(ref, path, {"name", "key"})
    name = _name(r, ref, "name", path)
    key = r.string(ref, "key", path, required=default_key is None, default=default_key)
    if key is not None and (len(key) > 253 or not SECRET_KEY.match(key)):
        r.fail(f"{path}.key", f"must be a Secret key (letters, digits, '-', '_', '.'), got "
               f"{key[:80]!r}")  # fmt: skip
        return None
    return SecretKey(name, key) if name and key else None


def _relative_path(r: FieldReader, obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = r.string(obj, key, path, required=False)
    if value is not None and (value.startswith("/") or ".." in value.split("/")):
        r.fail(f"{path}.{key}", f"must be a path inside the volume (relative, no '..'), got "
               f"{value[:80]!r}")  # fmt: skip
        return None
    return value


def _absolute_path(
    r: FieldReader, obj: Mapping[str, Any], key: str, path: str, default: str | None = None
) -> str | None:
    value = r.string(obj, key, path, required=default is None, default=default)
    if value is not None and (not value.startswith("/") or ".." in value.split("/")):
        r.fail(f"{path}.{key}", f"must be an absolute path with no '..', got {value[:80]!r}")
        return None
    return value


def _source(r: FieldReader, obj: Any) -> Source | None:
    path = "spec.model.source"
    src = r.mapping(obj, path)
    if src is None:
        return None
    r.unknown(src, path, set(SOURCE_KINDS))
    given = [k for k in SOURCE_KINDS if k in src]
    if len(given) != 1:
        r.fail(path, f"set exactly one of {', '.join(SOURCE_KINDS)}; got "
               f"{', '.join(given) or 'none'}")  # fmt: skip
        return None
    kind, sub = given[0], f"{path}.{given[0]}"
    body = r.mapping(src[kind], sub)
    if body is None:
        return None
    if kind == "pvc":
        r.unknown(body, sub, {"claimName", "subPath"})
        claim = _name(r, body, "claimName", sub)
        sub_path = _relative_path(r, body, "subPath", sub)
        return PvcSource(claim, sub_path) if claim else None
    if kind == "hostPath":
        r.unknown(body, sub, {"path"})
        host = _absolute_path(r, body, "path", sub)
        return HostPathSource(host) if host else None
    if kind == "image":
        r.unknown(body, sub, {"reference", "path"})
        reference = r.string(body, "reference", sub)
        if reference is not None and (len(reference) > 512 or any(c.isspace() for c in reference)):
            r.fail(f"{sub}.reference", f"must be an image reference with no spaces, got "
                   f"{reference[:80]!r}")  # fmt: skip
            reference = None
        inside = _absolute_path(r, body, "path", sub, default=DEFAULT_IMAGE_PATH)
        return ImageSource(reference, inside) if reference and inside else None
    r.unknown(body, sub, {"repo", "revision", "tokenSecret"})
    repo = r.string(body, "repo", sub)
    if repo is not None and (len(repo) > 200 or not HF_REPO.match(repo)):
        r.fail(f"{sub}.repo", f"must be a repository id such as meta-llama/Llama-3.1-8B-Instruct, "
               f"got {repo[:80]!r}")  # fmt: skip
        repo = None
    revision = r.string(body, "revision", sub, required=False)
    if revision is not None and (len(revision) > 255 or any(c.isspace() for c in revision)):
        r.fail(f"{sub}.revision", f"must be a branch, tag or commit, got {revision[:80]!r}")
        revision = None
    token = None
    if "tokenSecret" in body:
        token = _secret_key(r, body["tokenSecret"], f"{sub}.tokenSecret", default_key="token")
    return HuggingFaceSource(repo, revision, token) if repo else None


def _mapping_list(r: FieldReader, obj: Any, path: str) -> list[Mapping[str, Any]] | None:
    if obj is None:
        return None
    if not isinstance(obj, list) or len(obj) > MAX_ITEMS:
        r.fail(path, f"must be a list of at most {MAX_ITEMS} entries")
        return None
    items = [r.mapping(item, f"{path}[{i}]") for i, item in enumerate(obj)]
    return [i for i in items if i is not None] if None not in items else None


def _tolerations(r: FieldReader, obj: Any, path: str) -> tuple[Mapping[str, Any], ...] | None:
    items = _mapping_list(r, obj, path)
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
    items = _mapping_list(r, obj, path)
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
    template = _template(r, obj, path)
    if r.errors:
        raise SpecError(r.errors)
    return template


def _template(r: FieldReader, obj: Any, path: str) -> PodTemplate:
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
    pull = _mapping_list(r, t.get("imagePullSecrets"), f"{path}.imagePullSecrets")
    pull_names = None
    if pull is not None:
        names = [_name(r, p, "name", f"{path}.imagePullSecrets[{i}]") for i, p in enumerate(pull)]
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
        priority_class_name=_name(r, t, "priorityClassName", path, required=False),
        runtime_class_name=_name(r, t, "runtimeClassName", path, required=False),
        image_pull_secrets=pull_names,
        resources=Resources(
            gpus,
            _quantity(r, res, "cpu", f"{path}.resources"),
            _quantity(r, res, "memory", f"{path}.resources"),
        ),
        shm_size=_quantity(r, t, "shmSize", path),
    )


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def _engine(r: FieldReader, obj: Any) -> Engine:
    path = "spec.engine"
    e = r.mapping(obj, path, required=False)
    if e is None:
        return Engine()
    r.unknown(e, path, {"kind", "image", "args"})
    kind = r.string(e, "kind", path, required=False, choices=ENGINE_KINDS, default="kvbank")
    image = r.string(e, "image", path, required=False)
    args = e.get("args") or []
    if not isinstance(args, list) or len(args) > MAX_ENGINE_ARGS:
        r.fail(f"{path}.args", f"must be a list of at most {MAX_ENGINE_ARGS} strings")
        args = []
    for i, arg in enumerate(args):
        if not isinstance(arg, str) or len(arg) > MAX_ARG_LENGTH:
            r.fail(f"{path}.args[{i}]", f"must be a string of at most {MAX_ARG_LENGTH} characters")
        elif kind in RENDERED_FLAGS and _flag(arg) in RENDERED_FLAGS[kind]:
            r.fail(
                f"{path}.args[{i}]",
                f"sets {_flag(arg)}, which the operator renders from the spec (kv, limits, "
                "admission, apiKeySecret); drop it and set the spec field",
            )
    return Engine(kind or "kvbank", image, tuple(a for a in args if isinstance(a, str)))


def parse_deployment(doc: Any) -> Deployment:
    """The pod-facing fields of a ModelPool manifest. Raises SpecError listing every problem."""
    r = FieldReader()
    spec = (doc or {}).get("spec") if isinstance(doc, Mapping) else None
    spec = spec if isinstance(spec, Mapping) else {}
    model = spec.get("model")
    model = model if isinstance(model, Mapping) else {}
    source = _source(r, model["source"]) if "source" in model else None
    template = _template(r, spec.get("template"), "spec.template")
    engine = _engine(r, spec.get("engine"))
    api_key = None
    if "apiKeySecret" in spec:
        api_key = _secret_key(r, spec["apiKeySecret"], "spec.apiKeySecret", DEFAULT_API_KEY)
    if r.errors:
        raise SpecError(r.errors)
    return Deployment(source, template, engine, api_key)
