"""The one capacity function: how many KV pages a request may need.

The operator's webhook, `kvbank check`, the sidecar's ledger and the engine all call
`count_pages`, so what `kubectl apply` accepts is exactly what the runtime can admit. Everything
else here (the worst-case request, the holdability rules, the refusal messages) is derived by
calling it, never by repeating its arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from kvbank.modelpool import KvSlot, ModelPool

GIB = 1 << 30
SINK_PAGES = 1  # one page absorbs padding rows and unread labels; it is never allocated


@dataclass(frozen=True)
class CapacityModel:
    """What the capacity function needs to know about a model and its pool's page size."""

    kv_slots: Mapping[str, KvSlot]
    page_size: int
    max_seq_len: int
    max_tokens: int  # the limit, and the budget of a request that sends no max_tokens
    speculative_tokens: int = 0

    @classmethod
    def from_pool(cls, pool: ModelPool) -> CapacityModel:
        return cls(
            pool.kv_slots,
            pool.kv.page_size,
            pool.limits.max_seq_len,
            pool.limits.max_tokens,
            pool.kv.speculative_tokens,
        )


@dataclass(frozen=True)
class RequestShape:
    """A request as the model and the server's tokenizer count it (never the client)."""

    prompt_tokens: int
    max_tokens: int | None = None  # None: the model's limit
    # Tokens the model itself adds to a label for this request (an image's tokens, say); they
    # are the model's own count and are reserved whole, even past max_seq_len.
    extra_tokens: Mapping[str, int] = field(default_factory=dict)
    # The labels this request writes; the others go to the sink page. None: every label.
    labels: frozenset[str] | None = None


@dataclass(frozen=True)
class PageCount:
    per_label: Mapping[str, int]
    tokens_per_label: Mapping[str, int]
    output_tokens: int  # the output budget after the max_seq_len cap
    cached: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_label.values())

    @property
    def need(self) -> int:
        """Pages still to find once the cached prefix is leased."""
        return self.total - self.cached


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def output_budget(model: CapacityModel, prompt_tokens: int, max_tokens: int | None) -> int:
    """Output tokens a request may produce: its max_tokens (the model's limit when it sends none),
    capped so that prompt plus output stays within max_seq_len."""
    budget = model.max_tokens if max_tokens is None else max_tokens
    return max(0, min(budget, model.max_seq_len - prompt_tokens))


@dataclass(frozen=True)
class LabelTerms:
    """What one request writes into one label: tokens per prompt token, per output position,
    and its own tokens (the label's fixed tokens plus the model's extra tokens for this
    request), which are reserved whole."""

    per_prompt: int
    per_output: int
    own: int


def label_terms(model: CapacityModel, request: RequestShape) -> dict[str, LabelTerms]:
    """The labels a request writes, in the model's order; the others go to the sink page. The
    engine lays out its page tables from this, so it writes exactly what count_pages counts."""
    return {
        label: LabelTerms(slot.prompt, slot.output, slot.fixed + request.extra_tokens.get(label, 0))
        for label, slot in model.kv_slots.items()
        if request.labels is None or label in request.labels
    }


def count_pages(model: CapacityModel, request: RequestShape, cached_pages: int = 0) -> PageCount:
    """Pages one request may need, per label: its prompt, its output budget and one speculative
    step. A label's prompt count (prompt tokens x multiplier, fixed tokens, the model's extra
    tokens) is reserved whole; what decode adds is capped at max_seq_len positions."""
    output = output_budget(model, request.prompt_tokens, request.max_tokens)
    decode_positions = output + model.speculative_tokens
    per_label: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for label, terms in label_terms(model, request).items():
        label_tokens = (
            terms.per_prompt * request.prompt_tokens
            + terms.own
            + terms.per_output * decode_positions
        )
        tokens[label] = label_tokens
        per_label[label] = pages_for(label_tokens, model.page_size)
    total = sum(per_label.values())
    return PageCount(per_label, tokens, output, min(cached_pages, total))


@dataclass(frozen=True)
class LabelGrowth:
    """How one label of one request fills as it decodes: `base` tokens once its prompt is in,
    `per_output` more per output token, never more than `worst` (count_pages's count, which
    includes the speculative step)."""

    base: int
    per_output: int
    worst: int


def label_growth(
    model: CapacityModel, request: RequestShape
) -> tuple[dict[str, LabelGrowth], PageCount]:
    """Per label, the request's token timeline, read off count_pages so that the worst case a
    timeline reaches is exactly the one the ledger reserves."""
    count = count_pages(model, request)
    decode_positions = count.output_tokens + model.speculative_tokens
    growth = {}
    for label, worst in count.tokens_per_label.items():
        rate = model.kv_slots[label].output
        growth[label] = LabelGrowth(worst - rate * decode_positions, rate, worst)
    return growth, count


def pages_for_labels(tokens_per_label: Mapping[str, int], page_size: int) -> int:
    """Pages a request holds with these tokens per label (the sum count_pages takes)."""
    return sum(pages_for(tokens, page_size) for tokens in tokens_per_label.values())


def worst_case(model: CapacityModel) -> tuple[RequestShape, PageCount]:
    """The request of this model that needs the most pages, computed exactly.

    Along prompt + output = max_seq_len every label's tokens are linear in the prompt length p
    (`rise x p + base`), so the total page count is a sum of step functions. It lies within one
    page per label of the linear sum of tokens / page_size, whose maximum is at an end of the
    range; so only prompts where that linear sum comes within a page per label of the best end
    can do better, and among those only the prompts where a rising label steps up. That leaves a
    handful of candidates even at page size 1 and a million positions (one to a few per label),
    except for specs whose rises cancel out exactly, where it is one per page per rising label.
    """
    longest_output = min(model.max_tokens, model.max_seq_len - 1)
    lo, hi = model.max_seq_len - longest_output, model.max_seq_len - 1  # prompt lengths
    page, spec = model.page_size, model.speculative_tokens

    def at(prompt: int) -> tuple[RequestShape, PageCount]:
        shape = RequestShape(prompt, model.max_seq_len - prompt)
        return shape, count_pages(model, shape)

    best = max(at(lo), at(hi), key=lambda found: found[1].total)
    lines = [
        (slot.prompt - slot.output, slot.fixed + slot.output * (model.max_seq_len + spec))
        for slot in model.kv_slots.values()
    ]
    # Prompts whose summed tokens exceed (best + 1 - labels) pages could still beat the best end.
    slope = sum(rise for rise, _ in lines)
    offset = sum(base for _, base in lines)
    threshold = (best[1].total + 1 - len(lines)) * page - offset  # need slope x p > threshold
    if slope > 0:
        lo = max(lo, threshold // slope + 1)
    elif slope < 0:
        hi = min(hi, -(-threshold // slope) - 1)
    elif threshold >= 0:
        return best
    for rise, base in lines:
        if rise <= 0 or lo > hi:
            continue
        for step in range((rise * lo + base) // page, (rise * hi + base) // page + 1):
            prompt = -(-(step * page + 1 - base) // rise)  # first prompt past the step
            if lo <= prompt <= hi:
                found = at(prompt)
                if found[1].total > best[1].total:
                    best = found
    return best


def usable_pages(pool_pages: int) -> int:
    return pool_pages - SINK_PAGES


# ---- GPU memory ---------------------------------------------------------------------------------


def kv_heads_per_rank(pool: ModelPool) -> int:
    """KV heads one rank stores: split when TP divides them, replicated when TP exceeds them."""
    return max(1, pool.architecture.kv_heads // pool.tensor_parallel)


def page_bytes(pool: ModelPool) -> int:
    arch = pool.architecture
    return (
        2
        * arch.layers
        * kv_heads_per_rank(pool)
        * arch.head_dim
        * arch.dtype_bytes
        * pool.kv.page_size
    )


def weight_bytes_per_rank(pool: ModelPool) -> float:
    arch = pool.architecture
    return arch.parameters * arch.dtype_bytes / pool.tensor_parallel


def memory_budget_bytes(pool: ModelPool) -> float:
    return pool.gpu.memory_gib * pool.gpu.memory_utilization * GIB


def pool_pages(pool: ModelPool) -> int:
    """Pages per rank: the spec's count, or its fraction of what weights and reserve leave."""
    if pool.kv.pages is not None:
        return pool.kv.pages
    left = memory_budget_bytes(pool) - weight_bytes_per_rank(pool) - pool.gpu.reserved_gib * GIB
    fraction = pool.kv.memory_fraction or 0.0
    return max(0, int(left * fraction // page_bytes(pool)))


# ---- Holdability --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holdability:
    pages: int
    worst_request_pages: int
    worst_concurrency: int  # worst-case requests the pool holds at once (conservative reading)
    violations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """Largest value in [lo, hi] for which the monotone predicate `fits` holds (binary search)."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _worst_fits(model: CapacityModel, usable: int, **changes: int) -> bool:
    changed = replace(model, **changes)  # type: ignore[arg-type]
    if changed.max_tokens >= changed.max_seq_len:
        changed = replace(changed, max_tokens=changed.max_seq_len - 1)
    return worst_case(changed)[1].total <= usable


def describe_worst(model: CapacityModel, shape: RequestShape, count: PageCount) -> str:
    spec = model.speculative_tokens
    spec_part = f" + {spec} speculative token{'s' if spec != 1 else ''}" if spec else ""
    if len(count.per_label) == 1 and all(
        s.prompt == 1 and s.output == 1 and s.fixed == 0 for s in model.kv_slots.values()
    ):
        return (
            f"{count.total} pages: maxSeqLen {model.max_seq_len}{spec_part} at pageSize "
            f"{model.page_size}"
        )
    # sorted: the apiserver hands the webhook kvSlots in key order, and both must print alike
    labels = ", ".join(f"{label} {pages}" for label, pages in sorted(count.per_label.items()))
    return (
        f"{count.total} pages: a {shape.prompt_tokens}-token prompt with "
        f"{count.output_tokens} output tokens{spec_part} at pageSize {model.page_size}; "
        f"per label {labels}"
    )


def holdability(pool: ModelPool) -> Holdability:
    """Every reason the pool could not hold what the spec promises, each with the numbers and
    what to change. An empty tuple means the spec is holdable."""
    model = CapacityModel.from_pool(pool)
    pages = pool_pages(pool)
    usable = usable_pages(pages)
    shape, worst = worst_case(model)
    problems: list[str] = []

    if worst.total > usable:
        fixes = [f"Raise kv.pages to at least {worst.total + SINK_PAGES}"]
        seq = _largest_fitting(
            2, model.max_seq_len - 1, lambda n: _worst_fits(model, usable, max_seq_len=n)
        )
        if seq is not None:
            fixes.append(f"lower limits.maxSeqLen to at most {seq}")
        out = _largest_fitting(
            1, model.max_tokens - 1, lambda n: _worst_fits(model, usable, max_tokens=n)
        )
        if out is not None and any(s.output > s.prompt for s in model.kv_slots.values()):
            fixes.append(f"lower limits.maxTokens to at most {out}")
        where = "kv.pages" if pool.kv.pages is not None else "the pool sized by kv.memoryFraction"
        problems.append(
            f"{where}={pages} cannot hold one worst-case request "
            f"({describe_worst(model, shape, worst)}). {', or '.join(fixes)}."
        )

    concurrency = usable // worst.total if worst.total else 0
    need = pool.admission.min_concurrency
    if need and concurrency < need and worst.total <= usable:
        problems.append(
            f"admission.minConcurrency={need} needs {need * worst.total + SINK_PAGES} pages "
            f"({need} x {worst.total} per worst-case request + {SINK_PAGES} sink page) but "
            f"kv.pages={pages} holds {concurrency}. Raise kv.pages to at least "
            f"{need * worst.total + SINK_PAGES}, or lower admission.minConcurrency to "
            f"{concurrency}."
        )

    arch, tp = pool.architecture, pool.tensor_parallel
    if arch.attention_heads % tp:
        problems.append(
            f"tensorParallel={tp} does not divide model.architecture.attentionHeads="
            f"{arch.attention_heads}. Use a tensorParallel that divides it "
            f"({', '.join(str(d) for d in _divisors(arch.attention_heads) if d <= 64)})."
        )
    if arch.kv_heads % tp and tp % arch.kv_heads:
        problems.append(
            f"tensorParallel={tp} cannot split model.architecture.kvHeads={arch.kv_heads}: "
            f"one must divide the other. Use tensorParallel "
            f"{' or '.join(str(d) for d in _divisors(arch.kv_heads))}, or a multiple of "
            f"{arch.kv_heads}."
        )

    budget = memory_budget_bytes(pool)
    weights = weight_bytes_per_rank(pool)
    kv_bytes = pages * page_bytes(pool)
    reserve = pool.gpu.reserved_gib * GIB
    if kv_bytes + weights + reserve > budget:
        room = int((budget - weights - reserve) // page_bytes(pool))
        fix = (
            f"Lower kv.pages to at most {room}"
            if room > 0
            else f"Raise tensorParallel above {tp} or use a larger GPU"
        )
        problems.append(
            f"pool + weights + reserve need {_gib(kv_bytes + weights + reserve)} GiB per rank "
            f"(kv {_gib(kv_bytes)} GiB for {pages} pages of {page_bytes(pool)} bytes, weights "
            f"{_gib(weights)} GiB, reserved {_gib(reserve)} GiB) but gpu.memoryGiB="
            f"{pool.gpu.memory_gib:g} x memoryUtilization={pool.gpu.memory_utilization:g} "
            f"gives {_gib(budget)} GiB. {fix}, or raise gpu.memoryGiB."
        )
    if pool.kv.pages is None and pages < 2:
        problems.append(
            f"kv.memoryFraction={pool.kv.memory_fraction:g} leaves {pages} pages after weights "
            f"and reserve. Raise kv.memoryFraction or gpu.memoryGiB."
        )
    return Holdability(pages, worst.total, concurrency, tuple(problems))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


# ---- Per-request refusal ------------------------------------------------------------------------


def refusal(model: CapacityModel, request: RequestShape, pool_pages_total: int) -> str | None:
    """None when the pool can ever hold this request, else the message for the HTTP 400: the
    request's pages, the pool's, and what to change."""
    usable = usable_pages(pool_pages_total)
    count = count_pages(model, request)
    if count.total <= usable:
        return None
    advice = [f"raise the pool to at least {count.total + SINK_PAGES} pages"]
    budget = count.output_tokens
    if budget > 1:
        best = _largest_fitting(
            1,
            budget,
            lambda n: count_pages(model, _with_max_tokens(request, n)).total <= usable,
        )
        if best is not None:
            advice.insert(0, f"lower max_tokens to at most {best}")
    if len(advice) == 1:
        advice.insert(0, "shorten the prompt")
    return (
        f"this request needs {count.total} KV pages ({request.prompt_tokens} prompt tokens + "
        f"{count.output_tokens} max_tokens + {model.speculative_tokens} speculative at page size "
        f"{model.page_size}) but the pool holds {usable} pages for requests; "
        f"{', or '.join(advice)}"
    )


def _with_max_tokens(request: RequestShape, max_tokens: int) -> RequestShape:
    return replace(request, max_tokens=max_tokens)
