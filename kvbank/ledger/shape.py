"""Peak-fit admission: the pages admitted requests may hold at each future step, and its peak;
a waiting request's `PeakShape` and a running one's `Track`.

Every running request advances at least one token per step (the scheduler's promise, checked
each step by `Timeline.end_step`) and at most `advance` (1 + spec when every draft token may be
accepted, 1 when the engine writes one token per decode row and allocates `spec` lookahead
positions). So a request with `tokens` per label, `chunks` prefill chunks left and `remaining`
output tokens still allowed holds at future step k (k = 0 is the next step) at most, per label,

    min(worst, tokens + per_output * (advance * j + lookahead))   for j >= 1

with lookahead = 1 + spec - advance, and its prompt while j <= 0. Decoding, j = k + 1 (a step
writes the token after the last one written: a request at d tokens needs the page of token d + 1
in the step that produces it). Prefilling, j = k: its prefill may end in the next step however
many chunks it may take, so its growth is counted from then, while its finish is counted from
its worst-case number of chunks: it has surely finished, and returned its exclusive pages, after
step chunks + remaining - 1. Summed over the running
requests, extra demand (pages beyond what each holds now, minus what finished ones return) only
rises between two finishes, so its peak is at the step before a finish: one candidate step per
running request. The timeline keeps that demand at the candidates (the profile,
kvbank/ledger/profile.py: carried from step to step, re-evaluating only the requests whose curve
changed), and an admission test evaluates only the newcomer's curve at them.

Why this keeps the promise, and where each assumption is kept: docs/admission.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvbank.capacity import CapacityModel, PageCount, RequestShape, label_growth, pages_for
from kvbank.fields import quote
from kvbank.ledger.types import InvalidPages
from kvbank.modelpool import MAX_LABELS

if TYPE_CHECKING:
    from kvbank.ledger.policy import PeakPolicy

Steps = npt.NDArray[np.int64]
NEVER = 1 << 40  # the finish step of a request whose progress the ledger is not told
# What keeps the timeline's int64 arithmetic exact. A curve is evaluated at steps below
# 4 x NEVER (a start at a finish, then up to NEVER prefill steps and NEVER output steps), so a
# label that grows by at most MAX_STEP_TOKENS a step stays below 2^62 tokens there, with room
# for its own tokens (below MAX_TOKENS). An honest shape is far inside both: a ModelPool label
# writes at most 64 tokens per output token, for at most 16 sequences and 65 positions a step
# (about 2^16), and a pool of at most 2^24 pages of 1024 tokens holds 2^34 tokens.
MAX_STEP_TOKENS = (1 << 62) // (4 * NEVER)
MAX_TOKENS = 1 << 40
MAX_LABEL_CHARS = 63  # a ModelPool's kvSlots label (kvbank/modelpool.py)


@dataclass(frozen=True)
class PeakShape:
    """A waiting request as the timeline sees it: per label its tokens once the prompt is in,
    tokens per output token and worst-case tokens; its output budget; its worst-case number of
    prefill chunks; and its worst-case pages (the ledger's reservation)."""

    base: tuple[int, ...]
    per_output: tuple[int, ...]
    worst: tuple[int, ...]
    output_budget: int
    prefill_chunks: int
    pages: int
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """What holds for any shape, whoever made it: one entry per label, and counts whose
        finish step fits the timeline (`check` adds what a request's pages and the ledger's
        policy say)."""
        n = len(self.base)
        if not n or len(self.per_output) != n or len(self.worst) != n:
            raise InvalidPages(
                f"a shape needs the same number (>= 1) of labels in base {quote(self.base)}, "
                f"per_output {quote(self.per_output)} and worst {quote(self.worst)}",
                "shape.base",
            )
        if self.pages < 0:
            raise InvalidPages(f"a shape's pages must be non-negative, got {self.pages}", "pages")
        for name in ("output_budget", "prefill_chunks"):
            value = getattr(self, name)
            if not 0 <= value <= NEVER:
                raise InvalidPages(
                    f"a shape's {name} {value} must be from 0 to {NEVER} (the step past which "
                    f"the ledger counts a request as never finishing)",
                    f"shape.{name}",
                )

    def check(self, rid: str, pages: int, policy: PeakPolicy | None) -> None:
        """Raise InvalidPages, naming the field, unless this can be the engine's own shape of a
        request of `pages` worst-case pages under `policy`: labels within a ModelPool's, base
        within worst, and, for a ledger that follows progress, each label's worst tokens filling
        exactly `pages` pages between them (`ceil(worst / page_size)` summed, as count_pages
        counts) and every figure within the bounds above. A shape past them would wrap the
        timeline's int64 arithmetic and let the ledger promise pages the pool does not have."""
        who = f"request {quote(rid)}"
        if self.pages != pages:
            raise InvalidPages(
                f"{who}: its shape counts {self.pages} worst-case pages but {pages} were "
                f"given; build both from the same count_pages",
                "pages",
            )
        labels = self.labels
        if len(self.base) > MAX_LABELS or (labels and len(labels) != len(self.base)):
            raise InvalidPages(
                f"{who}: a shape has one entry per label, at most {MAX_LABELS} labels, in "
                f"labels ({len(labels)}), base, per_output and worst ({len(self.base)})",
                "shape.labels",
            )
        if len(set(labels)) != len(labels) or not all(
            0 < len(label) <= MAX_LABEL_CHARS for label in labels
        ):
            raise InvalidPages(
                f"{who}: shape labels must be distinct names of 1 to {MAX_LABEL_CHARS} "
                f"characters, got {quote(list(labels))}",
                "shape.labels",
            )
        for name in ("base", "per_output", "worst"):
            if min(getattr(self, name)) < 0:
                raise InvalidPages(
                    f"{who}: shape {name} {quote(list(getattr(self, name)))} must be non-negative",
                    f"shape.{name}",
                )
        if any(b > w for b, w in zip(self.base, self.worst, strict=True)):
            raise InvalidPages(
                f"{who}: shape base tokens {quote(list(self.base))} exceed worst tokens "
                f"{quote(list(self.worst))}",
                "shape.base",
            )
        if policy is None:
            return  # a ledger that follows no progress reads only the pages
        page_size = policy.page_size
        counted = sum(pages_for(worst, page_size) for worst in self.worst)
        if counted != pages:
            raise InvalidPages(
                f"{who}: its shape's worst tokens {quote(list(self.worst))} fill {counted} "
                f"pages of {page_size} tokens, but it reserves {pages}; send the worst tokens "
                f"and the pages of the same count_pages",
                "shape.worst",
            )
        positions = 1 + policy.speculative_tokens  # written or allocated per step, at most
        fastest = max(self.per_output)
        if fastest * positions > MAX_STEP_TOKENS:
            raise InvalidPages(
                f"{who}: a label at per_output {fastest} grows by {fastest * positions} tokens "
                f"a step ({positions} positions); at most {MAX_STEP_TOKENS} are counted",
                "shape.per_output",
            )
        if self.output_budget >= NEVER:
            raise InvalidPages(
                f"{who}: output_budget {self.output_budget} must be below {NEVER}; send the "
                f"request's own output budget",
                "shape.output_budget",
            )
        if max(self.worst) > MAX_TOKENS:  # past any pool's tokens: see MAX_TOKENS
            raise InvalidPages(
                f"{who}: shape worst {quote(list(self.worst))} must be at most {MAX_TOKENS} "
                f"tokens per label",
                "shape.worst",
            )


def peak_shape(
    model: CapacityModel,
    request: RequestShape,
    prefill_chunks: int = 1,
    count: PageCount | None = None,
    live: int | None = None,
) -> PeakShape:
    """The shape of a request, read off the capacity function (or `count`, its result for this
    request: never recounted here). `live`: for a request of several sequences, how many still
    run (kvbank.capacity.label_growth); its pages are then what they may hold."""
    growth, count = label_growth(model, request, count, live)
    labels = list(growth.values())
    worst = tuple(g.worst for g in labels)
    return PeakShape(
        tuple(g.base for g in labels),
        tuple(g.per_output for g in labels),
        worst,
        count.output_tokens,
        prefill_chunks,
        count.total if live is None else sum(pages_for(w, model.page_size) for w in worst),
        tuple(growth),
    )


@dataclass
class Track:
    """A running request's progress. `exclusive` pages return to the pool when it finishes;
    the rest of what it holds is shared with other holders (a prefix) and stays."""

    tokens: list[int]  # per label, never below the label's prompt tokens
    per_output: tuple[int, ...]  # tokens per label per output token; 0: a flat (worst) curve
    worst: tuple[int, ...]
    chunks: int  # prefill steps left (worst case)
    remaining: int  # decode steps left at most: output budget - produced (NEVER: unknown)
    held: int
    exclusive: int
    budget: int
    base: tuple[int, ...]
    labels: tuple[str, ...] = ()
    produced: int = 0
    step_produced: int = 0  # produced when the step began
    moved: bool = True  # advanced since the last end_step

    @property
    def end(self) -> int:
        """First step at which the request has surely finished."""
        return min(NEVER, self.chunks + self.remaining)


@dataclass(frozen=True)
class Pace:
    """Tokens one decode step may add (`advance`) and positions allocated past them
    (`lookahead`); advance + lookahead = 1 + speculative tokens."""

    advance: int
    lookahead: int

    @classmethod
    def of(cls, speculative_tokens: int, max_advance: int | None = None) -> Pace:
        advance = 1 + speculative_tokens if max_advance is None else max_advance
        if not 1 <= advance <= 1 + speculative_tokens:
            raise ValueError(
                f"a step advances a request by 1 to 1 + speculative_tokens "
                f"({1 + speculative_tokens}) tokens, got max_advance {max_advance}"
            )
        return cls(advance, 1 + speculative_tokens - advance)


def track_for(shape: PeakShape, held: int, exclusive: int, peak: bool) -> Track:
    """The track of a request just admitted. Without peak, its curve is flat at its worst case
    (the conservative reading), but its finish is still known, for backfill."""
    if peak:
        rate = shape.per_output
        tokens = list(shape.base)
    else:
        rate = tuple(0 for _ in shape.per_output)
        tokens = list(shape.worst)
    return Track(
        tokens,
        rate,
        shape.worst,
        shape.prefill_chunks,
        shape.output_budget,
        held,
        exclusive,
        shape.output_budget,
        shape.base,
        shape.labels,
    )


def give_back_problem(track: Track, rid: str, shape: PeakShape | None, peak: bool) -> str | None:
    """What is wrong with the curve `shape` of a running request giving pages back, against its
    track (None: no new curve, or the same labels never above the track's curve; `peak`: the
    per-output rate is part of it)."""
    if shape is None or track.budget == NEVER:
        return None
    if shape.labels != track.labels:
        return f"request {rid!r} gives back labels {shape.labels}; it writes {track.labels}"
    checks = [("worst", shape.worst, track.worst)]
    if peak:  # a flat curve (the conservative reading) has no rate
        checks.append(("per_output", shape.per_output, track.per_output))
    for name, new, old in checks:
        if any(a > b for a, b in zip(new, old, strict=True)):
            return f"request {rid!r} gives back pages but its {name} {new} rose from {old}"
    return None


def newcomer(
    shape: PeakShape,
    pace: Pace,
    page_size: int,
    ks: Steps,
    start: int,
    hit_pages: int,
    idle_pages: int,
    peak: bool,
) -> Steps:
    """Extra demand of a request started at step `start` with a leased hit, at steps `ks`:
    nothing before it starts, its pages beyond the hit while it runs, minus its idle hit (the
    only part of the hit it alone holds) once it has finished."""
    end = start + shape.prefill_chunks + shape.output_budget
    if peak:
        pages = np.zeros(len(ks), dtype=np.int64)
        steps = np.maximum(ks - (start + min(shape.prefill_chunks, 1) - 1), 0)
        written = pace.advance * steps
        if pace.lookahead:
            written += pace.lookahead * np.minimum(steps, 1)
        for base, per_output, worst in zip(shape.base, shape.per_output, shape.worst, strict=True):
            tokens = np.minimum(base + per_output * written, worst)
            pages += (tokens + (page_size - 1)) // page_size
        pages -= hit_pages
    else:
        flat = sum(pages_for(worst, page_size) for worst in shape.worst) - hit_pages
        pages = np.full(len(ks), flat, dtype=np.int64)
    pages[ks >= end] = -idle_pages
    pages[ks < start] = 0
    return pages


def newcomer_at(
    shape: PeakShape,
    pace: Pace,
    page_size: int,
    k: int,
    hit_pages: int,
    idle_pages: int,
    peak: bool,
) -> int:
    """`newcomer` of a request started now, at the one step `k`, in Python integers: the early
    test of every request asked about needs one step, where an array costs more than the sum."""
    if k >= shape.prefill_chunks + shape.output_budget:
        return -idle_pages
    if not peak:
        return sum(pages_for(worst, page_size) for worst in shape.worst) - hit_pages
    steps = max(k - min(shape.prefill_chunks, 1) + 1, 0)
    written = pace.advance * steps + pace.lookahead * min(steps, 1)
    grown = zip(shape.base, shape.per_output, shape.worst, strict=True)
    return sum(pages_for(min(b + p * written, w), page_size) for b, p, w in grown) - hit_pages


def steps_for(shape: PeakShape, start: int) -> Steps:
    """The step at which a request started at `start` may set the peak beside the running ones
    (whose own such steps are the profile's candidates): the step before its finish. Its start
    need not be tried: between two events both its demand and the others' only rise, so each
    stretch peaks at its end, and after the last event nothing changes."""
    end = start + shape.prefill_chunks + shape.output_budget
    return np.array([max(start, end - 1)], dtype=np.int64)


def flat_shape(pages: int, page_size: int) -> PeakShape:
    """A request whose shape the ledger was not given: its worst case until it is released."""
    worst = (pages * page_size,)
    return PeakShape(worst, (0,), worst, NEVER, 0, pages)


def open_ended(shape: PeakShape) -> PeakShape:
    """A request admitted now that may start at any later step: at every step it holds at most
    what it would hold had it started at once (its curve only rises until its finish), but its
    finish is unknown, so it returns nothing. The profile evaluates such a track at its
    `NEVER - 1` candidate, where every bounded request has finished and it stands at worst."""
    return replace(shape, output_budget=NEVER)
