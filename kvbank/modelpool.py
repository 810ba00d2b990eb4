"""The ModelPool spec: one schema read by the operator, `kvbank check`, the sidecar and the engine.

Parsing never raises on bad input: it collects every problem as a `FieldError` naming the field,
what was wrong and what to write instead, so a user fixes a manifest in one pass. The model and
its shape (spec.model) are kvbank/model_spec.py's; this module holds the rest of the schema and
the parser of the whole document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbank.fields import FieldError, FieldReader, SpecError, check_size, key_path, quote
from kvbank.mode import DEFAULT_MODE, AdmissionMode
from kvbank.model_spec import Architecture, ConfigSource, read_model
from kvbank.service_class import DEFAULT_MAX_PREEMPTIONS as MAX_PREEMPTIONS_DEFAULT
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim

__all__ = ["FieldError", "FieldReader", "SpecError"]  # re-exported: readers of specs use them

API_GROUP = "kvbank.dev"
API_VERSION = "v1alpha1"
KIND = "ModelPool"

# Bounds that keep every product the capacity rules form inside 63 bits (CEL's int), and reject
# numbers no real deployment has.
MAX_PAGES = 1 << 24
MAX_PAGE_SIZE = 1024
MAX_SEQ_LEN = 1 << 22
MAX_SLOT_MULTIPLIER = 64
MAX_FIXED_TOKENS = 1 << 22
MAX_LABELS = 16
MAX_TP = 64
MAX_REPLICAS = 4096
MAX_SPECULATIVE = 64

ADMISSION_POLICIES = ("conservative", "peak")
SERVICE_CLASSES = tuple(c.value for c in ServiceClass)
VICTIMS = tuple(v.value for v in Victim)
# How best-effort admission estimates a request's output: the output lengths the pool has seen
# for that class (learned online), or SGLang's decaying ratio of its budget.
ESTIMATES = tuple(e.value for e in Estimate)
MAX_PREEMPTIONS = 64
MAX_POOL_NAME_LENGTH = 40  # leaves room for "-ranks", pod ordinals and revision hashes in 63
SPEC_FIELDS = ("model", "replicas", "tensorParallel", "gpu", "kv", "kvSlots", "limits", "admission")
# Where the pods run, what they mount and which engine they start: read by the operator alone
# (kvbank.deployment, with spec.model.source), so this reader only lets them through.
POD_FIELDS = ("template", "engine", "apiKeySecret", "routing")


@dataclass(frozen=True)
class KvSlot:
    """What ONE request writes into one KV label: tokens per prompt token, per output token, and
    a fixed count (an encoder window, say)."""

    prompt: int = 0
    output: int = 0
    fixed: int = 0


@dataclass(frozen=True)
class Gpu:
    memory_gib: float
    memory_utilization: float = 0.9
    reserved_gib: float = 0.0


@dataclass(frozen=True)
class KvPool:
    page_size: int
    pages: int | None = None  # per rank; None when sized by memory_fraction
    memory_fraction: float | None = None  # of the GPU memory left after weights and reserve
    speculative_tokens: int = 0
    host_pages: int = 0  # per rank, in host memory: evicted prefix pages kept for reload


# vLLM's default step budget for its API server on an 80 GiB-class GPU: a sliding window or an
# attention chunk holds two steps of it on top of itself (kvbank/capacity/layout.py).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    max_tokens: int
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class Admission:
    min_concurrency: int = 0
    # Peak-fit with EASY backfill: the same promise as the conservative banker, more requests at
    # once and no head-of-line wait for small requests (docs/benchmarks.md "Default policy").
    # Capacity and `kvbank check` judge the pool by the conservative worst case whatever the
    # policy: that is what the pool is guaranteed to hold at once.
    policy: str = "peak" if DEFAULT_MODE.peak else "conservative"
    backfill: bool = DEFAULT_MODE.backfill
    # Service classes (kvbank/service_class.py): what a request that names no service_tier is,
    # and how best-effort requests are preempted. Strict by default: nothing changes for a pool
    # that never heard of classes.
    default_class: ServiceClass = ServiceClass.STRICT
    max_preemptions: int = MAX_PREEMPTIONS_DEFAULT
    victim: Victim = Victim.NEWEST
    estimate: Estimate = Estimate.LEARNED
    # The order waiting strict requests meet the ledger in, inside vLLM (kvbank/vllm/order.py):
    # arrival, or those of a prefix a running request holds first. kvbank's engine: arrival.
    order: str = "fifo"

    @property
    def classes(self) -> ClassPolicy:
        return ClassPolicy(self.default_class, self.max_preemptions, self.victim, self.estimate)

    @property
    def mode(self) -> AdmissionMode:
        return AdmissionMode.of_spec(self.policy, self.backfill)

    @property
    def ledger_policy(self) -> str:
        """The name the engine and the sidecar run this as (kvbank/mode.py)."""
        return self.mode.name


# What `kvbank serve` and `kvbank sidecar` run unless told otherwise.
DEFAULT_POLICY = DEFAULT_MODE.name


@dataclass(frozen=True)
class ModelPool:
    name: str
    namespace: str
    model_name: str
    architecture: Architecture
    replicas: int
    tensor_parallel: int
    gpu: Gpu
    kv: KvPool
    kv_slots: Mapping[str, KvSlot]
    limits: Limits
    admission: Admission = field(default_factory=Admission)
    # The model's layout comes from its config.json (kvbank/capacity/configured.py resolves it);
    # `architecture` then holds only placeholders and must not be read for capacity.
    from_config: ConfigSource | None = None


def _max_num_batched_tokens(r: FieldReader, lim: Mapping[str, Any]) -> int:
    """spec.limits.maxNumBatchedTokens: the most tokens the engine schedules in one step."""
    value = r.integer(lim, "maxNumBatchedTokens", "spec.limits", lo=1, hi=MAX_SEQ_LEN,
                      default=DEFAULT_MAX_NUM_BATCHED_TOKENS)  # fmt: skip
    return DEFAULT_MAX_NUM_BATCHED_TOKENS if value is None else value


def _kv_slots(r: FieldReader, obj: Any) -> dict[str, KvSlot]:
    path = "spec.kvSlots"
    slots = r.mapping(obj, path)
    if slots is None:
        return {}
    if not slots:
        r.fail(path, "must name at least one KV label, e.g. main: {prompt: 1, output: 1}")
    if len(slots) > MAX_LABELS:
        r.fail(path, f"has {len(slots)} labels; at most {MAX_LABELS} are allowed")
    result: dict[str, KvSlot] = {}
    for label, slot in slots.items():
        lpath = key_path(path, label)
        if not isinstance(label, str) or not label or len(label) > 63:
            r.fail(lpath, "a label must be a non-empty string of at most 63 characters")
            continue
        s = r.mapping(slot, lpath)
        if s is None:
            continue
        r.unknown(s, lpath, {"prompt", "output", "fixed"})
        prompt = r.integer(s, "prompt", lpath, lo=0, hi=MAX_SLOT_MULTIPLIER, default=0)
        output = r.integer(s, "output", lpath, lo=0, hi=MAX_SLOT_MULTIPLIER, default=0)
        fixed = r.integer(s, "fixed", lpath, lo=0, hi=MAX_FIXED_TOKENS, default=0)
        if None in (prompt, output, fixed):
            continue
        assert prompt is not None and output is not None and fixed is not None
        if prompt == output == fixed == 0:
            r.fail(lpath, "writes nothing; set prompt, output or fixed above 0, or drop the label")
            continue
        result[label] = KvSlot(prompt, output, fixed)
    return result


CLASS_FIELDS = ("defaultClass", "bestEffort")
# spec.admission.order, which vLLM's scheduler class carries out (KVBANK_ORDER)
ORDERS = ("fifo", "prefix")
Classes = tuple[ServiceClass, int, Victim, Estimate]


def _classes(r: FieldReader, adm: Mapping[str, Any]) -> Classes:
    """spec.admission's class fields: defaultClass and bestEffort {maxPreemptions, victim,
    estimate}, with the defaults of `Admission` for what is left out."""
    path = "spec.admission"
    if adm.get("defaultClass") in ("flex", "priority"):  # OpenAI's tier names, not classes
        meant = "best-effort" if adm["defaultClass"] == "flex" else "strict"
        told = adm["defaultClass"]
        r.fail(f"{path}.defaultClass", f"{told!r} is a service_tier, not a class; write "
               f"defaultClass: {meant} (one of {', '.join(SERVICE_CLASSES)})")  # fmt: skip
        cls = None
    else:
        cls = r.string(adm, "defaultClass", path, required=False, choices=SERVICE_CLASSES,
                       default=Admission.default_class.value)  # fmt: skip
    sub = f"{path}.bestEffort"
    best = r.mapping(adm.get("bestEffort"), sub, required=False) or {}
    r.unknown(best, sub, {"maxPreemptions", "victim", "estimate"})
    most = r.integer(best, "maxPreemptions", sub, lo=0, hi=MAX_PREEMPTIONS,
                     default=Admission.max_preemptions)  # fmt: skip
    victim = r.string(best, "victim", sub, required=False, choices=VICTIMS,
                      default=Admission.victim.value)  # fmt: skip
    estimate = r.string(best, "estimate", sub, required=False, choices=ESTIMATES,
                        default=Admission.estimate.value)  # fmt: skip
    if cls is None or most is None or victim is None or estimate is None:
        return (
            Admission.default_class,
            Admission.max_preemptions,
            Admission.victim,
            Admission.estimate,
        )
    return ServiceClass(cls), most, Victim(victim), Estimate(estimate)


def parse_modelpool(doc: Any) -> ModelPool:
    """Read a ModelPool manifest (a dict as from YAML). Raises SpecError listing every problem."""
    too_big = check_size(doc)
    if too_big is not None:  # before anything walks it
        raise SpecError([too_big])
    r = FieldReader()
    top = r.mapping(doc, "manifest")
    if top is None:
        raise SpecError(r.errors)
    api_version = top.get("apiVersion")
    if api_version != f"{API_GROUP}/{API_VERSION}":
        r.fail("apiVersion", f"must be {API_GROUP}/{API_VERSION}, got {quote(api_version)}")
    if top.get("kind") != KIND:
        r.fail("kind", f"must be {KIND}, got {quote(top.get('kind'))}")
    meta = r.mapping(top.get("metadata"), "metadata") or {}
    name = r.kube_name(meta, "name", "metadata", service=True) or ""
    if len(name) > MAX_POOL_NAME_LENGTH:
        r.fail(
            "metadata.name",
            f"has {len(name)} characters; at most {MAX_POOL_NAME_LENGTH} leave room for the "
            f"names of its pods and services",
        )
    namespace = r.kube_name(meta, "namespace", "metadata", service=False, default="default")
    spec = r.mapping(top.get("spec"), "spec")
    if spec is None:
        raise SpecError(r.errors)
    r.unknown(spec, "spec", {*SPEC_FIELDS, *POD_FIELDS})

    model_name, arch, source = read_model(r, spec)

    replicas = r.integer(spec, "replicas", "spec", lo=0, hi=MAX_REPLICAS, default=1)
    tp = r.integer(spec, "tensorParallel", "spec", lo=1, hi=MAX_TP, default=1)

    gpu_obj = r.mapping(spec.get("gpu"), "spec.gpu") or {}
    r.unknown(gpu_obj, "spec.gpu", {"memoryGiB", "memoryUtilization", "reservedGiB"})
    memory = r.number(gpu_obj, "memoryGiB", "spec.gpu", lo=0, hi=4096, lo_open=True)
    util = r.number(gpu_obj, "memoryUtilization", "spec.gpu", lo=0, hi=1, default=0.9, lo_open=True)
    reserved = r.number(gpu_obj, "reservedGiB", "spec.gpu", lo=0, hi=4096, default=0.0)

    kv_obj = r.mapping(spec.get("kv"), "spec.kv") or {}
    r.unknown(
        kv_obj, "spec.kv", {"pageSize", "pages", "memoryFraction", "speculativeTokens", "hostPages"}
    )
    page_size = r.integer(kv_obj, "pageSize", "spec.kv", lo=1, hi=MAX_PAGE_SIZE)
    pages: int | None = None
    fraction: float | None = None
    if "pages" in kv_obj and "memoryFraction" in kv_obj:
        r.fail("spec.kv", "set either pages or memoryFraction, not both")
    elif "memoryFraction" in kv_obj:
        fraction = r.number(kv_obj, "memoryFraction", "spec.kv", lo=0, hi=1, lo_open=True)
    else:
        pages = r.integer(kv_obj, "pages", "spec.kv", lo=2, hi=MAX_PAGES)
    spec_tokens = r.integer(
        kv_obj, "speculativeTokens", "spec.kv", lo=0, hi=MAX_SPECULATIVE, default=0
    )
    host_pages = r.integer(kv_obj, "hostPages", "spec.kv", lo=0, hi=MAX_PAGES, default=0)

    if source is not None and "kvSlots" in spec:
        r.fail("spec.kvSlots", "comes from model.architecture.fromConfig (one label per KV "
               "group); drop kvSlots")  # fmt: skip
    slots = _kv_slots(r, spec.get("kvSlots")) if source is None else {}

    lim = r.mapping(spec.get("limits"), "spec.limits") or {}
    r.unknown(lim, "spec.limits", {"maxSeqLen", "maxTokens", "maxNumBatchedTokens"})
    batched = _max_num_batched_tokens(r, lim)
    max_seq_len = r.integer(lim, "maxSeqLen", "spec.limits", lo=2, hi=MAX_SEQ_LEN)
    max_tokens = r.integer(lim, "maxTokens", "spec.limits", lo=1, hi=MAX_SEQ_LEN)
    if max_seq_len and max_tokens and max_tokens >= max_seq_len:
        r.fail(
            "spec.limits.maxTokens",
            f"must be below maxSeqLen ({max_seq_len}) so a prompt fits, got {max_tokens}",
        )

    adm = r.mapping(spec.get("admission"), "spec.admission", required=False) or {}
    r.unknown(adm, "spec.admission",
              {"minConcurrency", "policy", "backfill", "order", *CLASS_FIELDS})  # fmt: skip
    min_conc = r.integer(adm, "minConcurrency", "spec.admission", lo=0, hi=MAX_PAGES, default=0)
    policy = r.string(
        adm,
        "policy",
        "spec.admission",
        required=False,
        choices=ADMISSION_POLICIES,
        default=Admission.policy,
    )
    backfill = adm.get("backfill", Admission.backfill)
    if not isinstance(backfill, bool):
        r.fail("spec.admission.backfill", f"must be true or false, got {quote(backfill)}")

    classes = _classes(r, adm)
    order = r.string(adm, "order", "spec.admission", required=False, choices=ORDERS,
                     default=Admission.order)  # fmt: skip

    if r.errors:
        raise SpecError(r.errors)
    assert arch and memory and util and reserved is not None and page_size and tp
    assert replicas is not None and spec_tokens is not None and max_seq_len and max_tokens
    assert min_conc is not None and policy and host_pages is not None
    return ModelPool(
        name=name,
        namespace=namespace or "default",
        model_name=model_name,
        architecture=arch,
        replicas=replicas,
        tensor_parallel=tp,
        gpu=Gpu(memory, util, reserved),
        kv=KvPool(page_size, pages, fraction, spec_tokens, host_pages),
        kv_slots=slots,
        limits=Limits(max_seq_len, max_tokens, batched),
        admission=Admission(min_conc, policy, bool(backfill), *classes, order=order or "fifo"),
        from_config=source,
    )
