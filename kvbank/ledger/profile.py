"""The peak-fit profile: extra demand of the running requests at their candidate steps, carried
from one profile to the next instead of rebuilt.

A rebuild evaluates every request at every candidate step, O(requests x candidates): about
1.4 ms at 256 running, paid in every step with a waiting head (each progress report changes the
timeline). Most of that work repeats the previous profile's. A decoding request that advanced
exactly as its bound assumed (`advance` tokens per output step, its finish as many steps
closer, no page taken, no change in what it alone holds) has the same curve in absolute steps:
its term at a candidate k now is its term at k + steps-closed in the previous profile, already
in that profile's sums. So `Profile.follow` takes the previous sums, takes out the old terms of
the requests whose curve changed (and of those gone), adds their new terms, and evaluates afresh
only the candidate steps that are new (the next step, the finishes of changed requests):
O(changed x candidates + requests x new candidates). Which requests changed is read off the
numbers themselves, never off the caller's bookkeeping, and the sums are integers, so a followed
profile equals the rebuild exactly (tests/peak/test_profile_follow.py checks it after every
operation of random sequences). When most requests changed, a rebuild is cheaper and is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import is_

import numpy as np
import numpy.typing as npt

from kvbank.ledger.shape import NEVER, Pace, Steps, Track

# Below this many (request-label rows x candidates), a rebuild costs less than following the
# previous profile: finding what changed costs a few dozen small numpy calls.
FOLLOW_FROM = 16_384


@dataclass(frozen=True)
class Lines:
    """The bound of the requests as an evaluation reads it. Per (request, label) row, once its
    step count j = k + offset is positive, it may hold `tokens + per_output * (advance * j +
    lookahead)` = start + slope * k tokens, capped at `cap`, and its `prompt` before. `start`,
    `cap` and `prompt` carry page_size - 1 (a ceiling is then a floor) and, on the request's
    first row, minus its held pages times page_size (pages beyond held come out of the
    division): neither costs a pass over the matrix. Per request: its label rows, its exclusive
    pages and its end (the first step it has surely finished)."""

    page_size: int
    rows: Steps
    row_starts: Steps
    row_offset: Steps
    slope: Steps
    start: Steps
    cap: Steps
    prompt: Steps
    exclusive: Steps
    end: Steps

    @property
    def single_label(self) -> bool:
        return len(self.start) == len(self.rows)

    def subset(self, requests: Steps, closed: int = 0) -> Lines:
        """The given requests, their curves read `closed` steps later (the term at k is theirs
        at k + closed)."""
        if self.single_label:
            rows, counts, starts = requests, self.rows[requests], np.arange(len(requests))
        else:
            counts = self.rows[requests]
            starts = np.cumsum(counts) - counts
            within = np.arange(int(counts.sum())) - np.repeat(starts, counts)
            rows = np.repeat(self.row_starts[requests], counts) + within
        slope = self.slope[rows]
        return Lines(
            self.page_size,
            counts,
            starts,
            self.row_offset[rows] + closed,
            slope,
            self.start[rows] + slope * closed,
            self.cap[rows],
            self.prompt[rows],
            self.exclusive[requests],
            self.end[requests] - closed,
        )


@dataclass(frozen=True)
class Columns:
    """The running requests as numpy columns, in the timeline's order, and their `lines`.
    Per request: its label rows and `numbers` (held, exclusive, chunks, remaining). Per
    (request, label) row: tokens, per_output and worst. `tracks` are the objects read; `kept`:
    they are the objects of the table it was made `like`, in the same order, whose rows,
    per_output and worst it kept (a track never changes them once made)."""

    tracks: tuple[Track, ...]
    rids: tuple[str, ...]
    kept: bool
    rows: Steps
    row_starts: Steps
    numbers: npt.NDArray[np.int64]  # [requests, 4]: held, exclusive, chunks, remaining
    tokens: Steps
    per_output: Steps
    worst: Steps
    lines: Lines

    @classmethod
    def of(
        cls, tracks: Mapping[str, Track], page_size: int, pace: Pace, like: Columns | None = None
    ) -> Columns:
        values, rids = tuple(tracks.values()), tuple(tracks)
        kept = like is not None and like.rids == rids and all(map(is_, values, like.tracks))
        # One flat list per kind, converted once: cheaper than a conversion per field.
        if kept and like is not None and like.single_label:
            numbers = np.array(
                [
                    x
                    for t in values
                    for x in (t.held, t.exclusive, t.chunks, t.remaining, *t.tokens)
                ],
                dtype=np.int64,
            ).reshape(len(values), 5)
            numbers, tokens = numbers[:, :4], numbers[:, 4].copy()
        else:
            numbers = np.array(
                [x for t in values for x in (t.held, t.exclusive, t.chunks, t.remaining)],
                dtype=np.int64,
            ).reshape(len(values), 4)
            tokens = np.array([x for t in values for x in t.tokens], dtype=np.int64)
        if kept and like is not None:
            rows, row_starts, per_output, worst = (
                like.rows,
                like.row_starts,
                like.per_output,
                like.worst,
            )
        else:
            rows = np.array([len(t.tokens) for t in values], dtype=np.int64)
            row_starts = np.cumsum(rows) - rows
            per_output = np.array([x for t in values for x in t.per_output], dtype=np.int64)
            worst = np.array([x for t in values for x in t.worst], dtype=np.int64)
        held, exclusive, chunks, remaining = numbers.T.copy()
        offset = 1 - np.minimum(chunks, 1)  # j = k + offset: 1 decoding, 0 in prefill
        row_offset = offset if len(tokens) == len(rows) else np.repeat(offset, rows)
        slope = per_output * pace.advance
        lift = np.full(len(tokens), page_size - 1, dtype=np.int64)
        lift[row_starts] -= held * page_size
        lines = Lines(
            page_size,
            rows,
            row_starts,
            row_offset,
            slope,
            tokens + per_output * pace.lookahead + slope * row_offset + lift,
            worst + lift,
            np.minimum(tokens, worst) + lift,
            exclusive,
            np.minimum(chunks + remaining, NEVER),  # Track.end
        )
        return cls(values, rids, kept, rows, row_starts, numbers, tokens, per_output, worst, lines)

    @property
    def single_label(self) -> bool:
        return len(self.tokens) == len(self.rows)


def demand_of(lines: Lines, ks: Steps) -> Steps:
    """Summed extra demand of the requests in `lines` at steps `ks`: each request's pages
    beyond what it holds while it runs, minus its exclusive pages once it has finished.
    O(requests x len(ks)), in as few passes over that matrix as the arithmetic allows."""
    if not len(lines.rows):
        return np.zeros(len(ks), dtype=np.int64)
    # tokens, pages: [request-label rows, len(ks)]
    tokens = lines.slope[:, None] * ks[None, :]
    tokens += lines.start[:, None]
    np.minimum(tokens, lines.cap[:, None], out=tokens)
    early = np.flatnonzero(ks + int(lines.row_offset.min()) <= 0)  # some row has j <= 0
    if len(early):
        before = ks[early][None, :] + lines.row_offset[:, None] <= 0
        tokens[:, early] = np.where(before, lines.prompt[:, None], tokens[:, early])
    page_size = lines.page_size
    if page_size & (page_size - 1) == 0:  # a shift: integer division is the slow step
        pages = np.right_shift(tokens, page_size.bit_length() - 1, out=tokens)
    else:
        pages = np.floor_divide(tokens, page_size, out=tokens)
    if not lines.single_label:
        pages = np.add.reduceat(pages, lines.row_starts, axis=0)
    np.maximum(pages, 0, out=pages)
    np.copyto(pages, -lines.exclusive[:, None], where=ks[None, :] >= lines.end[:, None])
    return pages.sum(axis=0)  # type: ignore[no-any-return]


def _distinct(steps: Steps) -> Steps:
    """The distinct values of sorted `steps` (np.unique hashes: slower at these sizes)."""
    keep = np.ones(len(steps), dtype=bool)
    np.not_equal(steps[1:], steps[:-1], out=keep[1:])
    return steps[keep]


class Profile:
    """Extra demand of the running requests at their candidate steps, and the pages their
    finishes return by then, as the tracks stood at timeline step `clock`; immutable (a
    timeline and its copies share it)."""

    def __init__(self, tracks: Mapping[str, Track], page_size: int, pace: Pace, clock: int = 0):
        self._arrange(Columns.of(tracks, page_size, pace), pace, clock)
        self.demand_at_candidates = self.evaluate(self.candidates)

    def _arrange(self, columns: Columns, pace: Pace, clock: int) -> None:
        """Everything but the demand: the candidates and the returns, O(requests log)."""
        self.columns, self.pace, self.clock = columns, pace, clock
        self._peak: tuple[int, int] | None = None
        self.page_size = columns.lines.page_size
        self.count = len(columns.rows)
        end = columns.lines.end
        order = np.argsort(end, kind="stable")
        self.ends_sorted = end[order]
        self.exclusive_by_end = columns.lines.exclusive[order]
        self.returned_by = np.concatenate([[0], np.cumsum(self.exclusive_by_end)])
        self.finishes = _distinct(self.ends_sorted[self.ends_sorted < NEVER])
        # The peak is just before a finish, or after the last one (where nothing changes).
        steps = np.concatenate([[0], np.maximum(self.ends_sorted - 1, 0), self.finishes[-1:]])
        self.candidates = _distinct(np.sort(steps.astype(np.int64, copy=False)))

    def follow(self, tracks: Mapping[str, Track], clock: int) -> Profile:
        """The profile of `tracks` at step `clock` (>= this one's), equal to a rebuild, from
        this one's sums and the requests whose curve changed since."""
        columns = Columns.of(tracks, self.page_size, self.pace, like=self.columns)
        closed = clock - self.clock
        profile = Profile.__new__(Profile)
        profile._arrange(columns, self.pace, clock)
        ks = profile.candidates
        if closed < 0 or not self.count or len(columns.tokens) * len(ks) < FOLLOW_FROM:
            profile.demand_at_candidates = profile.evaluate(ks)
            return profile
        if columns.kept:
            same = self._unchanged(columns, None, closed)
            changed_new = changed_old = np.flatnonzero(~same)
        else:
            index = self._old_index(columns)
            same = self._unchanged(columns, index, closed)
            changed_new = np.flatnonzero(~same)
            gone = np.ones(self.count, dtype=bool)
            gone[index[same]] = False
            changed_old = np.flatnonzero(gone)
        if len(changed_new) + len(changed_old) >= len(same):
            profile.demand_at_candidates = profile.evaluate(ks)  # a rebuild costs less
            return profile
        # Candidates this profile summed (one of its candidates, `closed` steps later) are
        # corrected by the changed requests; the others are evaluated over every request.
        at = np.minimum(np.searchsorted(self.candidates, ks + closed), len(self.candidates) - 1)
        known = self.candidates[at] == ks + closed
        demand = np.empty(len(ks), dtype=np.int64)
        if known.any():
            kept = ks[known]
            demand[known] = self.demand_at_candidates[at[known]]
            if len(changed_old):
                before = self.columns.lines.subset(changed_old, closed)
                demand[known] -= demand_of(before, kept)
            if len(changed_new):
                demand[known] += demand_of(columns.lines.subset(changed_new), kept)
        if not known.all():
            demand[~known] = profile.evaluate(ks[~known])
        profile.demand_at_candidates = demand
        return profile

    def _old_index(self, columns: Columns) -> Steps:
        """Per request of `columns`, its index here, or -1 if it was not running then."""
        position = {rid: i for i, rid in enumerate(self.columns.rids)}
        return np.array([position.get(rid, -1) for rid in columns.rids], dtype=np.int64)

    def _unchanged(
        self, columns: Columns, index: Steps | None, closed: int
    ) -> npt.NDArray[np.bool_]:
        """Per request of `columns` (`index`: where it sits here, -1 if it was not running;
        None: the same tracks in the same order), whether its term at every step k is its term
        here at k + closed. So it was: running, with the same held and exclusive pages and
        labels, `closed` steps fewer left (its finish that much closer; an unknown budget stays
        unknown), decoding unless no step closed (a prefill's growth starts at the next step,
        so its curve moves with the clock), and per label `advance` tokens per step further."""
        old = self.columns
        if index is None:
            numbers, tokens, per_output = old.numbers, old.tokens, old.per_output
            same = np.ones(len(numbers), dtype=bool)
        else:
            was = np.maximum(index, 0)
            numbers = old.numbers[was]
            # Each request's rows here, by its label count now: a name reused with other
            # labels reads whatever rows sit there (clipped), and `same` is False for it.
            rows = was
            if not columns.single_label:
                within = np.arange(len(columns.tokens)) - np.repeat(
                    columns.row_starts, columns.rows
                )
                rows = np.repeat(old.row_starts[was], columns.rows) + within
            rows = np.minimum(rows, len(old.tokens) - 1)
            tokens, per_output = old.tokens[rows], old.per_output[rows]
            same = (index >= 0) & (columns.rows == old.rows[was])
        if closed:
            numbers = numbers.copy()
            numbers[:, 3] -= np.where(numbers[:, 3] >= NEVER, 0, closed)
            same &= columns.numbers[:, 2] == 0
        same &= (columns.numbers == numbers).all(axis=1)
        same_rows = columns.tokens == tokens + per_output * (self.pace.advance * closed)
        if index is not None:
            same_rows &= (columns.per_output == per_output) & (columns.worst == old.worst[rows])
        if not columns.single_label:
            same_rows = np.logical_and.reduceat(same_rows, columns.row_starts)
        return same & same_rows  # type: ignore[no-any-return]

    def evaluate(self, ks: Steps) -> Steps:
        """Extra demand at any steps `ks`: O(requests x len(ks))."""
        return demand_of(self.columns.lines, ks)

    def demand(self, ks: Steps) -> Steps:
        """Extra demand at steps `ks` (sorted): read off the candidates, evaluated elsewhere."""
        idx = np.minimum(np.searchsorted(self.candidates, ks), len(self.candidates) - 1)
        known = self.candidates[idx] == ks
        out = self.demand_at_candidates[idx].copy()
        if not known.all():
            out[~known] = self.evaluate(ks[~known])
        return out  # type: ignore[no-any-return]

    def returned(self, ks: Steps, pinned: int = 0) -> Steps:
        """Exclusive pages the running requests have returned by steps `ks`; with `pinned`, as
        if each of them had that many fewer (a newcomer leases pages one of them held alone)."""
        by = self.returned_by
        if pinned:
            by = np.concatenate([[0], np.cumsum(np.maximum(self.exclusive_by_end - pinned, 0))])
        return by[np.searchsorted(self.ends_sorted, ks, side="right")]  # type: ignore[no-any-return]

    def peak(self) -> tuple[int, int]:
        """(highest extra demand, the step it is reached), found once: every request asked
        about in a step is tried against it first (`Timeline.over_at_peak`)."""
        if self._peak is None:
            i = int(np.argmax(self.demand_at_candidates))
            self._peak = int(self.demand_at_candidates[i]), int(self.candidates[i])
        return self._peak
