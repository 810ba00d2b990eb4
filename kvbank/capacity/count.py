"""The one capacity function, `count_pages`: how many KV pages a request may need, and what is
read off it (a label's growth, the model's worst-case request)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvbank.modelpool import KvSlot, ModelPool

SINK_PAGES = 1  # one page absorbs padding rows and unread labels; it is never allocated


@dataclass(frozen=True)
class CapacityModel:
    """What the capacity function needs to know about a model and its pool's page size."""

    kv_slots: Mapping[str, KvSlot]
    page_size: int
    max_seq_len: int
    max_tokens: int  # the limit, and the budget of a request that sends no max_tokens
    speculative_tokens: int = 0
    # The most pages one sequence holds in a label at once, whatever its length: a sliding
    # window's or an attention chunk's label (kvbank.capacity.layout). A label not named here
    # holds every position it writes, as kvSlots always have.
    label_caps: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_pool(cls, pool: ModelPool) -> CapacityModel:
        if pool.from_config is not None:  # its labels are its layout's, which needs the file
            raise ValueError(
                "this ModelPool's architecture is fromConfig: its KV labels come from the "
                "model's config.json (kvbank.capacity.configured.resolve), not from kvSlots"
            )
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
    # Sequences sampled from the one prompt (OpenAI's `n`). They share the prompt's pages where
    # every label is keyed (`shared_prompt_pages`); each writes the rest itself.
    sequences: int = 1


@dataclass(frozen=True)
class PageCount:
    per_label: Mapping[str, int]  # all sequences of the request together
    tokens_per_label: Mapping[str, int]  # what one sequence writes (its prompt included)
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
    request), which are reserved whole and written with its first chunk. The engine lays out a
    request's page tables from these, so it writes exactly what count_pages counts."""

    name: str
    per_prompt: int
    per_output: int
    own: int
    # A sliding window's or an attention chunk's label (`CapacityModel.label_caps`): the most
    # tokens' worth of pages it holds at once (its cap x the page size). None: every position.
    cap_tokens: int | None = None

    @property
    def keyed(self) -> bool:
        """Whether the label's tokens are exactly the prompt tokens, so the prefix cache may key
        it: anything else (an image's tokens, an encoder window) is not described by the prompt,
        so two equal prompts do not mean equal KV there. A capped label's pages are reused as
        the window moves, so they hold no prefix to key."""
        return self.per_prompt == 1 and self.own == 0 and self.cap_tokens is None

    def tokens_at(self, positions: int, prompt_tokens: int) -> int:
        """Label tokens once `positions` positions (prompt first, then output) are written, as
        pages hold them: at most `cap_tokens` for a capped label."""
        if positions <= 0:
            return 0
        prompt_part = min(positions, prompt_tokens)
        tokens = (
            self.per_prompt * prompt_part + self.own + self.per_output * (positions - prompt_part)
        )
        return tokens if self.cap_tokens is None else min(tokens, self.cap_tokens)


def label_terms(model: CapacityModel, request: RequestShape) -> dict[str, LabelTerms]:
    """The labels a request writes, in the model's order; the others go to the sink page."""
    caps = model.label_caps
    return {
        label: LabelTerms(
            label,
            slot.prompt,
            slot.output,
            slot.fixed + request.extra_tokens.get(label, 0),
            caps[label] * model.page_size if label in caps else None,
        )
        for label, slot in model.kv_slots.items()
        if request.labels is None or label in request.labels
    }


def shared_prompt_pages(model: CapacityModel, request: RequestShape) -> int:
    """Pages per label that the sequences of a request with `sequences > 1` hold once, together:
    the prompt's pages before the one holding its last token. Each sequence computes that last
    token itself (its logits give the sequence's first token), so the page holding it, full or
    partial, is each sequence's own copy. Nothing is shared when some label is not keyed (its
    tokens are not described by the prompt, so the prefix machinery cannot share them), nor for
    a single sequence."""
    if request.sequences <= 1 or not all(t.keyed for t in label_terms(model, request).values()):
        return 0
    if model.label_caps:  # a window drops its prompt's first pages: nothing stays shared
        return 0
    return (request.prompt_tokens - 1) // model.page_size


def count_pages(model: CapacityModel, request: RequestShape, cached_pages: int = 0) -> PageCount:
    """Pages one request may need, per label: its prompt, its output budget and one speculative
    step. A label's prompt count (prompt tokens x multiplier, fixed tokens, the model's extra
    tokens) is reserved whole; what decode adds is capped at max_seq_len positions. A request of
    n sequences counts its shared prompt pages once and, n times, the pages each sequence writes
    itself (the page holding its last prompt token onwards). A label with a cap
    (`CapacityModel.label_caps`) counts its tokens up to that many pages, never more."""
    output = output_budget(model, request.prompt_tokens, request.max_tokens)
    decode_positions = output + model.speculative_tokens
    sequences = request.sequences
    shared = shared_prompt_pages(model, request)
    per_label: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for label, terms in label_terms(model, request).items():
        label_tokens = (
            terms.per_prompt * request.prompt_tokens
            + terms.own
            + terms.per_output * decode_positions
        )
        cap = model.label_caps.get(label)
        if cap is not None:
            label_tokens = min(label_tokens, cap * model.page_size)
        tokens[label] = label_tokens
        one = pages_for(label_tokens, model.page_size)
        per_label[label] = shared + sequences * (one - shared)
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
    model: CapacityModel,
    request: RequestShape,
    count: PageCount | None = None,
    live: int | None = None,
) -> tuple[dict[str, LabelGrowth], PageCount]:
    """Per label, the request's token timeline, read off count_pages (or `count`, its result
    for this request when the caller has it) so that the worst case a timeline reaches is
    exactly the one the ledger reserves. `live`: of a request's sequences, how many still run
    (the others finished and gave their share back); all of them by default."""
    if count is None:
        count = count_pages(model, request)
    decode_positions = count.output_tokens + model.speculative_tokens
    page = model.page_size
    sequences = request.sequences if live is None else live
    shared = shared_prompt_pages(model, request)
    growth = {}
    for label, worst in count.tokens_per_label.items():
        rate = model.kv_slots[label].output
        base = worst - rate * decode_positions
        if label in model.label_caps:  # it fills as any label, until its cap
            slot = model.kv_slots[label]
            own = slot.fixed + request.extra_tokens.get(label, 0)
            base = min(worst, slot.prompt * request.prompt_tokens + own)
        if request.sequences == 1:
            growth[label] = LabelGrowth(base, rate, worst)
            continue
        # n sequences grow at once, so n times the rate; their tokens are read as a group's
        # (group_tokens): each sequence's own tokens padded to pages, so that the pages of the
        # sum bound the sum of its sequences' pages.
        group_worst = (shared + sequences * (pages_for(worst, page) - shared)) * page
        own_base = base - shared * page
        start = group_tokens(page, shared, group_worst, [own_base] * sequences)
        growth[label] = LabelGrowth(start, sequences * rate, group_worst)
    return growth, count


def group_tokens(
    page_size: int,
    shared: int,
    worst: int,
    own_tokens: Iterable[int],
    finished_pages: int = 0,
) -> int:
    """A label's tokens for a request of several sequences, as its peak shape reads them: its
    `shared` pages in full, each running sequence's own tokens (past the shared pages) plus
    page_size - 1, and the pages the finished ones had, capped at the count's `worst` (pages x
    page_size). As ceil(t / p) <= (t + p - 1) / p, the pages of this sum, grown by n times a
    sequence's rate, are at least the sequences' own pages summed, however each grows."""
    padded = sum(tokens + page_size - 1 for tokens in own_tokens)
    return min(worst, (shared + finished_pages) * page_size + padded)


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
    A label's cap (`label_caps`) keeps its pages a monotone step function with a subset of its
    steps and lowers them only, so the same candidates and the same bound still hold.
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


def largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
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
