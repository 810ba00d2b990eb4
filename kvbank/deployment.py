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
from dataclasses import dataclass, field
from typing import Any

from kvbank.fields import FieldReader, SpecError
from kvbank.pod_template import (
    AFFINITY_KINDS,
    APPARMOR_TYPES,
    DNS_NAME,
    MAX_GPUS_PER_RANK,
    MAX_ITEMS,
    QUANTITY,
    SELINUX_TYPES,
    TAINT_EFFECTS,
    TOLERATION_OPERATORS,
    WHEN_UNSATISFIABLE,
    PodTemplate,
    Resources,
    SecurityAdditions,
    parse_template,
    read_name,
    read_template,
)

# Re-exported: readers of the pod-facing fields find them all here.
__all__ = [
    "AFFINITY_KINDS",
    "APPARMOR_TYPES",
    "DNS_NAME",
    "MAX_GPUS_PER_RANK",
    "MAX_ITEMS",
    "QUANTITY",
    "SELINUX_TYPES",
    "TAINT_EFFECTS",
    "TOLERATION_OPERATORS",
    "WHEN_UNSATISFIABLE",
    "PodTemplate",
    "Resources",
    "SecurityAdditions",
    "parse_template",
]  # fmt: skip

ENGINE_KINDS = ("kvbank", "vllm")
SOURCE_KINDS = ("pvc", "hostPath", "image", "huggingFace")
DEFAULT_API_KEY = "api-key"
DEFAULT_IMAGE_PATH = "/models"
MAX_ENGINE_ARGS = 64
MAX_ARG_LENGTH = 256
# The flags each engine gets from the spec; setting one in spec.engine.args would contradict
# the figures the webhook judged.
RENDERED_FLAGS = {
    "kvbank": (
        "--host", "--port", "--sidecar", "--sidecar-token-file", "--sidecar-ca-file", "--model",
        "--pages", "--page-size", "--max-seq-len", "--max-tokens", "--policy", "--api-key-file",
        "--host-pages", "--default-class", "--max-preemptions", "--victim", "--estimate",
    ),
    "vllm": (
        "--port", "--scheduler-cls", "--block-size", "--num-gpu-blocks-override",
        "--max-model-len", "--tensor-parallel-size", "--api-key", "--served-model-name",
        "--gpu-memory-utilization",
    ),
}  # fmt: skip

# spec.admission.bestEffort settings a vllm pool may carry only at the CRD's defaults (its
# maxPreemptions is the scheduler class's KVBANK_MAX_PREEMPTIONS).
VLLM_BEST_EFFORT_DEFAULTS = {"victim": "newest", "estimate": "learned"}

SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
HF_REPO = re.compile(r"^[A-Za-z0-9][-\w.]*(/[-\w.]+)?$")


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
    # spec.routing.picker: "kvbank" renders an InferencePool and `kvbank picker` over the pool's
    # rank-0 pods (kvbank.operator.render.picker); "none" keeps the traffic Service alone.
    picker: str = "none"


PICKERS = ("none", "kvbank")


# ---- field readers ----------------------------------------------------------------------


def _secret_key(
    r: FieldReader, obj: Any, path: str, default_key: str | None = None
) -> SecretKey | None:
    ref = r.mapping(obj, path)
    if ref is None:
        return None
    r.unknown(ref, path, {"name", "key"})
    name = read_name(r, ref, "name", path)
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
        claim = read_name(r, body, "claimName", sub)
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


def _section(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def _vllm_refusals(r: FieldReader, spec: Mapping[str, Any]) -> None:
    """What a pool asks that the vllm engine would not carry out, refused rather than dropped.
    Only values set and well-formed are judged: `kvbank.modelpool` reports malformed ones."""
    kv = _section(spec, "kv")
    host = kv.get("hostPages")
    if isinstance(host, int) and not isinstance(host, bool) and host > 0:
        r.fail(
            "spec.kv.hostPages",
            f"is {host}, but spec.engine.kind vllm has no host tier "
            "kvbank's ledger counts (vLLM's own CPU offloading, --kv-offloading-size, reloads "
            "pages behind kvbank's scheduler class); set hostPages: 0, or engine kind kvbank",
        )
    # kvbank's vLLM scheduler class runs both classes (kvbank/vllm/classes.py): the default
    # class and maxPreemptions are its; its victim is always the latest best-effort request
    # (vLLM's own preemption order) and it admits a best-effort request on its prompt alone.
    best = _section(_section(spec, "admission"), "bestEffort")
    changed = {
        k: v
        for k, v in best.items()
        if k in VLLM_BEST_EFFORT_DEFAULTS and VLLM_BEST_EFFORT_DEFAULTS[k] != v
    }
    if changed:
        r.fail(
            "spec.admission.bestEffort",
            f"sets {', '.join(sorted(map(str, changed)))}, but under spec.engine.kind vllm "
            "a best-effort request is preempted latest first (vLLM's own order) and admitted on "
            "its prompt, with no output estimate; drop them, or use engine kind kvbank",
        )


def parse_deployment(doc: Any) -> Deployment:
    """The pod-facing fields of a ModelPool manifest. Raises SpecError listing every problem."""
    r = FieldReader()
    spec = (doc or {}).get("spec") if isinstance(doc, Mapping) else None
    spec = spec if isinstance(spec, Mapping) else {}
    model = spec.get("model")
    model = model if isinstance(model, Mapping) else {}
    source = _source(r, model["source"]) if "source" in model else None
    template = read_template(r, spec.get("template"), "spec.template")
    engine = _engine(r, spec.get("engine"))
    if engine.kind == "vllm":
        _vllm_refusals(r, spec)
    elif _section(spec, "admission").get("order") == "prefix":
        r.fail(
            "spec.admission.order",
            "is prefix, which kvbank's scheduler class inside vLLM carries out; kvbank's own "
            "engine asks in arrival order; drop it, or set spec.engine.kind: vllm",
        )
    api_key = None
    if "apiKeySecret" in spec:
        api_key = _secret_key(r, spec["apiKeySecret"], "spec.apiKeySecret", DEFAULT_API_KEY)
    picker = _picker(r, spec.get("routing"))
    if r.errors:
        raise SpecError(r.errors)
    return Deployment(source, template, engine, api_key, picker)


def _picker(r: FieldReader, obj: Any) -> str:
    routing = r.mapping(obj, "spec.routing", required=False)
    if routing is None:
        return "none"
    r.unknown(routing, "spec.routing", {"picker"})
    picker = r.string(routing, "picker", "spec.routing", required=False, choices=PICKERS)
    return picker or "none"
