"""Benchmark scenarios (the format of `scenarios/README.md`), parsed strictly.

Every problem is collected with the path of its field (`workload.classes[1].weight`), so a user
fixes a file in one pass: an unknown field, a negative size, a class with no weight, a label the
model does not have. Nothing is guessed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import CostModel
from kvbank.modelpool import KvSlot
from kvbank.service_class import ServiceClass


class ScenarioError(ValueError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


@dataclass(frozen=True)
class Span:
    """A number, or a uniform integer range {min, max}."""

    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


@dataclass(frozen=True)
class Slo:
    """A class's latency objective: a completed request met it when its time to first token
    and its mean time per output token are both within these (goodput counts those)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    prompt_tokens: Span
    output_tokens: Span
    max_tokens: int | None
    shared_prefix: str | None = None
    shared_prefix_tokens: int = 0
    fixed_label_tokens: Mapping[str, int] | None = None
    only_labels: frozenset[str] | None = None
    service_class: ServiceClass = ServiceClass.STRICT
    slo: Slo | None = None


@dataclass(frozen=True)
class Workload:
    requests: int
    seed: int
    classes: tuple[RequestClass, ...]
    concurrency: int | None = None  # closed loop
    rate_per_s: float | None = None  # open loop (Poisson)
    # Open loop: requests per arrival (a fan-out, a batch): each Poisson arrival brings a
    # burst of this many at once. None: one at a time.
    burst: Span | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    pages: int
    model: CapacityModel
    tp: int
    cost: CostModel
    time_limit_s: float
    workload: Workload
    host_pages: int = 0  # a host tier beside the device pool; 0: none
    replicas: int = 1  # engines behind a router (the cluster bench); 1: one engine
    # Labels that attend to a window only, {label: ("sliding_window" | "attention_chunk",
    # tokens)}: vLLM (--engine vllm) runs them as such KV cache groups and frees what falls
    # out of the window; kvbank's own engine keeps every position of them.
    kv_windows: Mapping[str, tuple[str, int]] = field(default_factory=dict)


class _Reader:
    """Walks a mapping, recording problems instead of raising, with the field's full path."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def mapping(self, value: Any, path: str, allowed: set[str], required: set[str]) -> dict:
        if not isinstance(value, Mapping):
            self.problems.append(f"{path}: must be a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in allowed:
                self.problems.append(
                    f"{_join(path, key)}: unknown field; allowed: {', '.join(sorted(allowed))}"
                )
        for key in sorted(required - set(value)):
            self.problems.append(f"{_join(path, key)}: required field is missing")
        return dict(value)

    def integer(self, value: Any, path: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}: must be an integer, got {value!r}")
            return minimum
        if value < minimum:
            self.problems.append(f"{path}: must be at least {minimum}, got {value}")
            return minimum
        return value

    def number(self, value: Any, path: str, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problems.append(f"{path}: must be a number, got {value!r}")
            return 1.0
        if value < 0 or (positive and value == 0):
            bound = "greater than 0" if positive else "at least 0"
            self.problems.append(f"{path}: must be {bound}, got {value}")
            return 1.0
        return float(value)

    def span(self, value: Any, path: str, minimum: int) -> Span:
        if isinstance(value, Mapping):
            body = self.mapping(value, path, {"min", "max"}, {"min", "max"})
            low = self.integer(body.get("min", minimum), f"{path}.min", minimum)
            high = self.integer(body.get("max", low), f"{path}.max", minimum)
            if high < low:
                self.problems.append(f"{path}: min {low} is greater than max {high}")
                high = low
            return Span(low, high)
        number = self.integer(value, path, minimum)
        return Span(number, number)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def load_scenario(path: str | Path) -> Scenario:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_scenario(data, str(path))


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    r = _Reader()
    top = r.mapping(
        data,
        "",
        {"name", "about", "pool", "model", "cost_model", "time_limit_s", "workload", "replicas"},
        {"name", "pool", "model", "workload"},
    )
    pool = r.mapping(
        top.get("pool", {}), "pool", {"pages", "page_size", "host_pages"}, {"pages", "page_size"}
    )
    pages = r.integer(pool.get("pages", 2), "pool.pages", 2)
    page_size = r.integer(pool.get("page_size", 1), "pool.page_size", 1)
    host_pages = r.integer(pool.get("host_pages", 0), "pool.host_pages")
    model, tp, windows = _model(r, top.get("model", {}), page_size)
    cost = _cost(r, top.get("cost_model", {}))
    limit = r.number(top.get("time_limit_s", 3600), "time_limit_s", positive=True)
    replicas = r.integer(top.get("replicas", 1), "replicas", 1)
    workload = _workload(r, top.get("workload", {}), set(model.kv_slots))
    if r.problems:
        raise ScenarioError(source, r.problems)
    name = top.get("name")
    about = str(top.get("about", ""))
    return Scenario(
        str(name), about, pages, model, tp, cost, limit, workload, host_pages, replicas, windows
    )


WINDOWS = ("sliding_window", "attention_chunk")


def _model(
    r: _Reader, value: Any, page_size: int
) -> tuple[CapacityModel, int, dict[str, tuple[str, int]]]:
    fields = {"kv_slots", "max_seq_len", "max_tokens_default", "speculative_tokens", "tp"}
    body = r.mapping(value, "model", fields, {"kv_slots", "max_seq_len"})
    slots: dict[str, KvSlot] = {}
    windows: dict[str, tuple[str, int]] = {}
    raw_slots = body.get("kv_slots", {})
    if not isinstance(raw_slots, Mapping) or not raw_slots:
        r.problems.append("model.kv_slots: must map at least one label to its slot")
        raw_slots = {}
    for label, slot in raw_slots.items():
        path = f"model.kv_slots.{label}"
        spec = r.mapping(slot, path, {"prompt", "output", "fixed", *WINDOWS}, set())
        slots[str(label)] = KvSlot(
            r.integer(spec.get("prompt", 0), f"{path}.prompt"),
            r.integer(spec.get("output", 0), f"{path}.output"),
            r.integer(spec.get("fixed", 0), f"{path}.fixed"),
        )
        given = [name for name in WINDOWS if name in spec]
        if len(given) > 1:
            r.problems.append(f"{path}: give one of {' or '.join(WINDOWS)}, not both")
        elif given:
            windows[str(label)] = (given[0], r.integer(spec[given[0]], f"{path}.{given[0]}", 1))
    max_seq_len = r.integer(body.get("max_seq_len", 2), "model.max_seq_len", 2)
    max_tokens = r.integer(
        body.get("max_tokens_default", max_seq_len - 1), "model.max_tokens_default", 1
    )
    spec_tokens = r.integer(body.get("speculative_tokens", 0), "model.speculative_tokens")
    tp = r.integer(body.get("tp", 1), "model.tp", 1)
    return CapacityModel(slots, page_size, max_seq_len, max_tokens, spec_tokens), tp, windows


def _cost(r: _Reader, value: Any) -> CostModel:
    names = (
        "step_base_ms", "prefill_ms_per_token", "decode_ms_per_row", "attn_ms_per_page",
        "host_ms_per_page",
    )  # fmt: skip
    body = r.mapping(value, "cost_model", set(names), set())
    defaults = CostModel()
    numbers = {
        name: r.number(body.get(name, getattr(defaults, name)), f"cost_model.{name}")
        for name in names
    }
    return CostModel(**numbers)


def _workload(r: _Reader, value: Any, labels: set[str]) -> Workload:
    fields = {"concurrency", "rate_per_s", "requests", "seed", "classes", "burst"}
    body = r.mapping(value, "workload", fields, {"requests", "classes"})
    concurrency = rate = None
    if ("concurrency" in body) == ("rate_per_s" in body):
        r.problems.append(
            "workload: set exactly one of concurrency (closed loop) or rate_per_s (open loop)"
        )
    if "concurrency" in body:
        concurrency = r.integer(body["concurrency"], "workload.concurrency", 1)
    if "rate_per_s" in body:
        rate = r.number(body["rate_per_s"], "workload.rate_per_s", positive=True)
    burst = None
    if "burst" in body:
        if rate is None:
            r.problems.append("workload.burst: bursts are open loop; set rate_per_s instead")
        burst = r.span(body["burst"], "workload.burst", 1)
    requests = r.integer(body.get("requests", 1), "workload.requests", 1)
    seed = r.integer(body.get("seed", 0), "workload.seed")
    raw = body.get("classes", [])
    if not isinstance(raw, list) or not raw:
        r.problems.append("workload.classes: must be a non-empty list of request classes")
        raw = []
    classes = tuple(_class(r, item, f"workload.classes[{i}]", labels) for i, item in enumerate(raw))
    return Workload(requests, seed, classes, concurrency, rate, burst)


def _class(r: _Reader, value: Any, path: str, labels: set[str]) -> RequestClass:
    fields = {
        "name", "weight", "prompt_tokens", "shared_prefix", "shared_prefix_tokens",
        "max_tokens", "output_tokens", "fixed_label_tokens", "only_labels", "service_class",
        "slo",
    }  # fmt: skip
    body = r.mapping(value, path, fields, {"weight", "prompt_tokens", "output_tokens"})
    name = str(body.get("name", path))
    weight = r.number(body.get("weight", 1), f"{path}.weight", positive=True)
    prompt = r.span(body.get("prompt_tokens", 1), f"{path}.prompt_tokens", 1)
    output = r.span(body.get("output_tokens", 1), f"{path}.output_tokens", 1)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        max_tokens = r.integer(max_tokens, f"{path}.max_tokens", 1)
    prefix = body.get("shared_prefix")
    prefix_tokens = r.integer(body.get("shared_prefix_tokens", 0), f"{path}.shared_prefix_tokens")
    if prefix is None and prefix_tokens:
        r.problems.append(f"{path}.shared_prefix_tokens: set shared_prefix to name the group")
    if prefix is not None and prefix_tokens > prompt.low:
        r.problems.append(
            f"{path}.shared_prefix_tokens: {prefix_tokens} exceeds the shortest prompt "
            f"({prompt.low} tokens)"
        )
    fixed: dict[str, int] | None = None
    if "fixed_label_tokens" in body:
        raw = r.mapping(body["fixed_label_tokens"], f"{path}.fixed_label_tokens", labels, set())
        fixed = {k: r.integer(v, f"{path}.fixed_label_tokens.{k}") for k, v in raw.items()}
    only: frozenset[str] | None = None
    if "only_labels" in body:
        raw_only = body["only_labels"]
        if not isinstance(raw_only, list) or not raw_only:
            r.problems.append(f"{path}.only_labels: must be a non-empty list of labels")
        else:
            unknown = [x for x in raw_only if x not in labels]
            if unknown:
                r.problems.append(
                    f"{path}.only_labels: {unknown} are not labels of model.kv_slots "
                    f"({', '.join(sorted(labels))})"
                )
            only = frozenset(str(x) for x in raw_only)
    service = _service_class(r, body.get("service_class", "strict"), f"{path}.service_class")
    if service is ServiceClass.BEST_EFFORT and fixed and any(fixed.values()):
        r.problems.append(
            f"{path}.service_class: a class with fixed_label_tokens (an image's or an audio "
            f"window's KV, which cannot be rebuilt) is always strict; remove service_class or "
            f"set it to strict"
        )
    slo = _slo(r, body["slo"], f"{path}.slo") if "slo" in body else None
    return RequestClass(
        name, weight, prompt, output, max_tokens,
        str(prefix) if prefix is not None else None, prefix_tokens, fixed, only, service, slo,
    )  # fmt: skip


def _service_class(r: _Reader, value: Any, path: str) -> ServiceClass:
    try:
        return ServiceClass(value)
    except ValueError:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        r.problems.append(
            f"{path}: must be one of {', '.join(c.value for c in ServiceClass)}, got {shown}"
        )
        return ServiceClass.STRICT


def _slo(r: _Reader, value: Any, path: str) -> Slo:
    body = r.mapping(value, path, {"ttft_s", "tpot_s"}, set())
    if isinstance(value, Mapping) and not body:
        r.problems.append(f"{path}: set ttft_s, tpot_s or both (seconds), or remove slo")
    bounds = {
        key: r.number(body[key], f"{path}.{key}", positive=True) if key in body else None
        for key in ("ttft_s", "tpot_s")
    }
    return Slo(bounds["ttft_s"], bounds["tpot_s"])
