"""Peak-fit admission: the pages admitted requests may hold at each future step, and its peak.

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
running request. The timeline keeps that demand at the candidates (the profile, rebuilt once
after each change: O(requests x candidates) in numpy), and an admission test evaluates only the
newcomer's curve at them.

Why this keeps the promise, and where each assumption is kept: docs/admission.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbank.capacity import CapacityModel, RequestShape, label_growth, pages_for

Steps = npt.NDArray[np.int64]
NEVER = 1 << 40  # the finish step of a request whose progress the ledger is not told


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
        n = len(self.base)
        if not n or len(self.per_output) != n or len(self.worst) != n:
            raise ValueError(
                f"a shape needs the same number (>= 1) of labels in base {self.base}, "
                f"per_output {self.per_output} and worst {self.worst}"
            )
        if self.output_budget < 0 or self.prefill_chunks < 0 or self.pages < 0:
            raise ValueError(
                f"output_budget {self.output_budget}, prefill_chunks {self.prefill_chunks} and "
                f"pages {self.pages} must be non-negative"
            )


def peak_shape(model: CapacityModel, request: RequestShape, prefill_chunks: int = 1) -> PeakShape:
    """The shape of a request, read off the capacity function (never recounted here)."""
    growth, count = label_growth(model, request)
    labels = list(growth.values())
    return PeakShape(
        tuple(g.base for g in labels),
        tuple(g.per_output for g in labels),
        tuple(g.worst for g in labels),
        count.output_tokens,
        prefill_chunks,
        count.total,
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


def flat_track(pages: int, page_size: int, held: int) -> Track:
    """A request whose shape the ledger was not given: its worst case, until it is released."""
    worst = (pages * page_size,)
    return Track(list(worst), (0,), worst, 0, NEVER, held, 0, NEVER, (0,))


class Profile:
    """Extra demand of the running requests at their candidate steps, and the pages their
    finishes return by then. Built from the tracks as they stand; immutable."""

    def __init__(self, tracks: list[Track], page_size: int, pace: Pace):
        self.page_size = page_size
        self.pace = pace
        n = len(tracks)
        self.count = n
        rows = [len(t.tokens) for t in tracks]
        self.single_label = all(r == 1 for r in rows)
        self.row_starts = np.cumsum([0, *rows[:-1]], dtype=np.int64) if n else np.zeros(0, int)
        # Column vectors, one row per (request, label), built once per profile.
        self.tokens = np.array([x for t in tracks for x in t.tokens], dtype=np.int64)[:, None]
        self.per_output = np.array([x for t in tracks for x in t.per_output], dtype=np.int64)[
            :, None
        ]
        self.worst = np.array([x for t in tracks for x in t.worst], dtype=np.int64)[:, None]
        prefilling = np.minimum(np.array([t.chunks for t in tracks], dtype=np.int64), 1)
        self.offset = np.repeat(1 - prefilling, rows)[:, None]  # j = k + offset
        self.held = np.array([t.held for t in tracks], dtype=np.int64)
        self.exclusive = np.array([t.exclusive for t in tracks], dtype=np.int64)
        self.end = np.array([t.end for t in tracks], dtype=np.int64)
        self._held_c, self._end_c = self.held[:, None], self.end[:, None]
        self._neg_exclusive_c = -self.exclusive[:, None]
        # A power-of-two page size divides by a shift (integer division is the slow step).
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        order = np.argsort(self.end, kind="stable")
        self.ends_sorted = self.end[order]
        self.exclusive_by_end = self.exclusive[order]
        self.returned_by = np.concatenate([[0], np.cumsum(self.exclusive_by_end)])
        finite = self.end[self.end < NEVER]
        self.finishes = np.unique(finite)
        # The peak is just before a finish, or after the last one (where nothing changes).
        after_last = self.finishes[-1:] if len(self.finishes) else np.zeros(0, np.int64)
        self.candidates = np.unique(
            np.concatenate([[0], np.maximum(self.end - 1, 0), after_last]).astype(np.int64)
        )
        self.demand_at_candidates = self._evaluate(self.candidates)

    def evaluate(self, ks: Steps) -> Steps:
        """Extra demand at any steps `ks`: O(requests x len(ks))."""
        return self._evaluate(ks)

    def _evaluate(self, ks: Steps) -> Steps:
        if self.count == 0:
            return np.zeros(len(ks), dtype=np.int64)
        # steps, tokens, pages: [request-label rows, len(ks)]
        steps = ks[None, :] + self.offset
        np.maximum(steps, 0, out=steps)
        written = steps * self.pace.advance if self.pace.advance != 1 else steps
        if self.pace.lookahead:
            written = written + self.pace.lookahead * np.minimum(steps, 1)
        tokens = self.tokens + self.per_output * written
        np.minimum(tokens, self.worst, out=tokens)
        if self._shift >= 0:
            tokens += self.page_size - 1
            pages = np.right_shift(tokens, self._shift, out=tokens)
        else:
            pages = -(-tokens // self.page_size)
        if not self.single_label:
            pages = np.add.reduceat(pages, self.row_starts, axis=0)
        pages -= self._held_c
        np.maximum(pages, 0, out=pages)
        term = np.where(ks[None, :] < self._end_c, pages, self._neg_exclusive_c)
        return term.sum(axis=0)  # type: ignore[no-any-return]

    def demand(self, ks: Steps) -> Steps:
        """Extra demand at steps `ks` (sorted): read off the candidates, evaluated elsewhere."""
        idx = np.minimum(np.searchsorted(self.candidates, ks), len(self.candidates) - 1)
        known = self.candidates[idx] == ks
        out = self.demand_at_candidates[idx].copy()
        if not known.all():
            out[~known] = self._evaluate(ks[~known])
        return out  # type: ignore[no-any-return]

    def returned(self, ks: Steps, pinned: int = 0) -> Steps:
        """Exclusive pages the running requests have returned by steps `ks`; with `pinned`, as
        if each of them had that many fewer (a newcomer leases pages one of them held alone)."""
        by = self.returned_by
        if pinned:
            by = np.concatenate([[0], np.cumsum(np.maximum(self.exclusive_by_end - pinned, 0))])
        return by[np.searchsorted(self.ends_sorted, ks, side="right")]  # type: ignore[no-any-return]

    def peak(self) -> tuple[int, int]:
        """(highest extra demand, the step it is reached)."""
        i = int(np.argmax(self.demand_at_candidates))
        return int(self.demand_at_candidates[i]), int(self.candidates[i])


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
