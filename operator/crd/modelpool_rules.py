"""CEL rules for the ModelPool CRD, derived from the capacity rules in `kvbank.capacity`.

CEL runs in the apiserver even when the operator is down, so it rejects what it can state
exactly: ranges the schema cannot, TP splitting the heads (presets included), and — for the
common single-label pool sized in pages — the worst-case request and `minConcurrency`. With one
label, pages are a monotone function of tokens and tokens are linear in the prompt along
prompt + output = maxSeqLen, so the worst case sits at an end of the prompt range (the argument
of `kvbank.capacity.worst_case`). Several labels step at different prompts; that case, the
memory fit and the policy are the webhook's.

Every number here is bounded by the schema so products stay far inside CEL's int64 (overflow is
an evaluation error, not a wrap): tokens <= 64 x 2^22 + 2^22 + 64 x (2^22 + 64) < 2^29, and
minConcurrency x worst <= 2^24 x 2^29 = 2^53.
"""

from __future__ import annotations

from kvbank.capacity import SINK_PAGES
from kvbank.model_spec import PRESETS
from kvbank.modelpool import MAX_POOL_NAME_LENGTH
from kvbank.operator.crd.openapi import rule

__all__ = ["MAX_POOL_NAME_LENGTH"]

ARCH = "self.model.architecture"
ARCH_FIELDS = ("layers", "attentionHeads", "kvHeads", "headDim", "parameters", "dtype")
FROM_CONFIG = f"{ARCH}.fromConfig"


def _format(template: str, *values: str) -> str:
    """A messageExpression through `format`: the apiserver's cost estimator bounds it, whereas
    `'...' + string(n)` is estimated as unbounded and refused."""
    return f"'{template}'.format([{', '.join(values)}])"


def _or_default(path: str, field: str, default: int | str) -> str:
    return f"(has({path}.{field}) ? {path}.{field} : {default})"


def _preset_map(attr: str) -> str:
    items = ", ".join(f"'{name}': {getattr(arch, attr)}" for name, arch in sorted(PRESETS.items()))
    return "{" + items + "}"


def _preset_or_field(path: str, field: str, attr: str) -> tuple[str, str]:
    """(CEL value, CEL 'is known') of an architecture field a preset may supply."""
    value = (
        f"(has({path}.{field}) ? {path}.{field} : "
        f"(has({path}.preset) ? {_preset_map(attr)}[{path}.preset] : 1))"
    )
    return value, f"(has({path}.{field}) || has({path}.preset))"


def architecture_rules() -> list[dict[str, str]]:
    heads, heads_known = _preset_or_field("self", "attentionHeads", "attention_heads")
    kv, kv_known = _preset_or_field("self", "kvHeads", "kv_heads")
    complete = " && ".join(f"has(self.{f})" for f in ARCH_FIELDS)
    beside = " || ".join(f"has(self.{f})" for f in ("preset", *ARCH_FIELDS))
    return [
        rule(
            f"has(self.fromConfig) || has(self.preset) || ({complete})",
            message=(
                "give a preset ("
                + ", ".join(sorted(PRESETS))
                + ") or all of "
                + ", ".join(ARCH_FIELDS)
                + ", or fromConfig"
            ),
        ),
        rule(
            f"!has(self.fromConfig) || !({beside})",
            message="fromConfig describes the model by itself; drop the other architecture "
            "fields beside it",
        ),
        rule(
            f"!({heads_known} && {kv_known}) || {kv} <= {heads}",
            message_expression=_format(
                "kvHeads must be at most attentionHeads (%d), got %d", heads, kv
            ),
        ),
        rule(
            f"!({heads_known} && {kv_known}) || {kv} > {heads} || {heads} % {kv} == 0",
            message_expression=_format(
                "kvHeads must divide attentionHeads (%d), got %d", heads, kv
            ),
        ),
    ]


def from_config_rules() -> list[dict[str, str]]:
    return [
        rule(
            "has(self.path) != has(self.configMap)",
            message="give exactly one of path (a local config.json) or configMap {name, key}",
        )
    ]


def _worst_pages(slot: str) -> str:
    """Pages of the single label's worst-case request (see the module docstring)."""
    prompt = _or_default(slot, "prompt", 0)
    output = _or_default(slot, "output", 0)
    fixed = _or_default(slot, "fixed", 0)
    seq, out = "self.limits.maxSeqLen", "self.limits.maxTokens"
    spec = _or_default("self.kv", "speculativeTokens", 0)
    page = "self.kv.pageSize"
    longest_output = f"({prompt} * ({seq} - {out}) + {fixed} + {output} * ({out} + {spec}))"
    longest_prompt = f"({prompt} * ({seq} - 1) + {fixed} + {output} * (1 + {spec}))"
    most = f"({longest_output} > {longest_prompt} ? {longest_output} : {longest_prompt})"
    return f"(({most} + {page} - 1) / {page})"


def structure_rules() -> list[dict[str, str]]:
    """Which of kvSlots and fromConfig a spec gives: the parser's own rule, not a capacity
    judgement."""
    return [
        rule(
            f"has(self.kvSlots) || has({FROM_CONFIG})",
            message="kvSlots is required unless model.architecture.fromConfig gives the "
            "model's KV groups",
        ),
        rule(
            f"!has(self.kvSlots) || !has({FROM_CONFIG})",
            message="kvSlots comes from model.architecture.fromConfig (one label per KV group); "
            "drop kvSlots",
        ),
    ]


def spec_rules() -> list[dict[str, str]]:
    """The capacity judgements the webhook also makes, kept in the schema so `kubectl apply`
    refuses the plain cases without a webhook."""
    tp = _or_default("self", "tensorParallel", 1)
    heads, heads_known = _preset_or_field(ARCH, "attentionHeads", "attention_heads")
    kv, kv_known = _preset_or_field(ARCH, "kvHeads", "kv_heads")
    worst = _worst_pages("self.kvSlots[k]")
    worst_value = f"self.kvSlots.map(k, {worst})[0]"
    usable = f"(self.kv.pages - {SINK_PAGES})"
    single_paged = (
        "!has(self.kvSlots) || !has(self.kv.pages) || self.kvSlots.size() != 1 "
        "|| self.limits.maxTokens >= self.limits.maxSeqLen"
    )
    min_conc = "self.admission.minConcurrency"
    return [
        rule(
            f"!{heads_known} || {heads} % {tp} == 0",
            message_expression=_format(
                "tensorParallel=%d does not divide model.architecture.attentionHeads=%d. "
                "Use a tensorParallel that divides it.",
                tp,
                heads,
            ),
        ),
        rule(
            f"!{kv_known} || {kv} % {tp} == 0 || {tp} % {kv} == 0",
            message_expression=_format(
                "tensorParallel=%d cannot split model.architecture.kvHeads=%d: one must divide "
                "the other. Use a divisor or a multiple of kvHeads.",
                tp,
                kv,
            ),
        ),
        rule(
            f"{single_paged} || self.kvSlots.all(k, {worst} <= {usable})",
            message_expression=_format(
                "kv.pages=%d cannot hold one worst-case request (%d pages at pageSize %d). "
                "Raise kv.pages to at least %d, or lower limits.maxSeqLen or limits.maxTokens "
                "(kvbank check prints how far).",
                "self.kv.pages",
                worst_value,
                "self.kv.pageSize",
                f"{worst_value} + {SINK_PAGES}",
            ),
        ),
        rule(
            f"{single_paged} || !has(self.admission) || !has({min_conc}) || "
            f"self.kvSlots.all(k, {worst} > {usable} || {usable} / {worst} >= {min_conc})",
            message_expression=_format(
                "admission.minConcurrency=%d needs %d pages but kv.pages=%d holds %d worst-case "
                "requests. Raise kv.pages to at least %d, or lower admission.minConcurrency to %d.",
                min_conc,
                f"{min_conc} * {worst_value} + {SINK_PAGES}",
                "self.kv.pages",
                f"{usable} / {worst_value}",
                f"{min_conc} * {worst_value} + {SINK_PAGES}",
                f"{usable} / {worst_value}",
            ),
        ),
    ]


def root_rules() -> list[dict[str, str]]:
    return [
        rule(
            f"self.metadata.name.size() <= {MAX_POOL_NAME_LENGTH}",
            message_expression=_format(
                f"metadata.name must be at most {MAX_POOL_NAME_LENGTH} characters (its pods, "
                "Services and revision hashes add suffixes within 63), got %d",
                "self.metadata.name.size()",
            ),
        )
    ]
