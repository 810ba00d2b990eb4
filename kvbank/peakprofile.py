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
from dataclasses import dataclass, replace
from operator import is_

import numpy as np
import numpy.typing as npt

from kvbank.peakfit import NEVER, Pace, Track

Steps = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Columns:
    """The running requests as numpy columns, in the timeline's order.

    Per request: its label rows, `offset` (j = k + offset: 1 decoding, 0 in prefill), held,
    exclusive and end (the first step it has surely finished). Per (request, label) row: tokens,
    per_output and worst, and the bound as a line in k, which is what an evaluation reads: once
    j > 0 a row may hold `tokens + per_output * (advance * j + lookahead)` = start + slope * k
    tokens, capped at worst, and its prompt before. `start`, `cap` and `prompt` carry page_size - 1
    (a ceiling is then a floor) and, on the request's first row, minus its held pages times
    page_size (pages beyond held come out of the division): neither costs a pass over the matrix.
    `tracks` are the objects read: a table of the same objects keeps what a track never changes
    once made (its labels, per_output and worst)."""

    page_size: int
    tracks: tuple[Track, ...]
    rids: tuple[str, ...]
    rows: Steps
    row_starts: Steps
    offset: Steps
    held: Steps
    exclusive: Steps
    end: Steps
    tokens: Steps
    per_output: Steps
    worst: Steps
    row_offset: Steps
    slope: Steps
    start: Steps
    cap: Steps
    prompt: Steps

    @classmethod
    def of(
        cls, tracks: Mapping[str, Track], page_size: int, pace: Pace, like: Columns | None = None
    ) -> Columns:
        values, rids = tuple(tracks.values()), tuple(tracks)
        # One flat list per kind, converted once: cheaper than a conversion per field.
        numbers = np.array(
            [x for t in values for x in (t.held, t.exclusive, t.chunks, t.remaining)],
            dtype=np.int64,
        ).reshape(len(values), 4)
        held, exclusive, chunks, remaining = numbers.T.copy()
        tokens = np.array([x for t in values for x in t.tokens], dtype=np.int64)
        if like is not None and like.rids == rids and all(map(is_, values, like.tracks)):
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
        offset = 1 - np.minimum(chunks, 1)
        row_offset = offset if len(tokens) == len(rows) else np.repeat(offset, rows)
        slope = per_output * pace.advance
        lift = np.full(len(tokens), page_size - 1, dtype=np.int64)
        lift[row_starts] -= held * page_size
        return cls(
            page_size,
            values,
            rids,
            rows,
            row_starts,
            offset,
            held,
            exclusive,
            np.minimum(chunks + remaining, NEVER),  # Track.end
            tokens,
            per_output,
            worst,
            row_offset,
            slope,
            tokens + per_output * pace.lookahead + slope * row_offset + lift,
            worst + lift,
            np.minimum(tokens, worst) + lift,
        )

    @property
    def single_label(self) -> bool:
        return len(self.tokens) == len(self.rows)

    def subset(self, requests: Steps, closed: int = 0) -> Columns:
        """The given requests, their curves read `closed` steps later (the term at k is theirs
        at k + closed)."""
        rows = requests
        counts = self.rows[requests]
        if not self.single_label:
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            rows = np.repeat(self.row_starts[requests], counts) + within
        return replace(
            self,
            tracks=(),
            rids=(),
            rows=counts,
            row_starts=np.cumsum(counts) - counts,
            offset=self.offset[requests] + closed,
            held=self.held[requests],
            exclusive=self.exclusive[requests],
            end=self.end[requests] - closed,
            tokens=self.tokens[rows],
            per_output=self.per_output[rows],
            worst=self.worst[rows],
            row_offset=self.row_offset[rows] + closed,
            slope=self.slope[rows],
            start=self.start[rows] + self.slope[rows] * closed,
            cap=self.cap[rows],
            prompt=self.prompt[rows],
        )


def demand_of(columns: Columns, ks: Steps) -> Steps:
    """Summed extra demand of the requests in `columns` at steps `ks`: each request's pages
    beyond what it holds while it runs, minus its exclusive pages once it has finished.
    O(requests x len(ks)), in as few passes over that matrix as the arithmetic allows."""
    if not len(columns.rows):
        return np.zeros(len(ks), dtype=np.int64)
    # tokens, pages: [request-label rows, len(ks)]
    tokens = columns.slope[:, None] * ks[None, :]
    tokens += columns.start[:, None]
    np.minimum(tokens, columns.cap[:, None], out=tokens)
    early = np.flatnonzero(ks + int(columns.row_offset.min()) <= 0)  # some row has j <= 0
    if len(early):
        before = ks[early][None, :] + columns.row_offset[:, None] <= 0
        tokens[:, early] = np.where(before, columns.prompt[:, None], tokens[:, early])
    page_size = columns.page_size
    if page_size & (page_size - 1) == 0:  # a shift: integer division is the slow step
        pages = np.right_shift(tokens, page_size.bit_length() - 1, out=tokens)
    else:
        pages = np.floor_divide(tokens, page_size, out=tokens)
    if not columns.single_label:
        pages = np.add.reduceat(pages, columns.row_starts, axis=0)
    np.maximum(pages, 0, out=pages)
    np.copyto(pages, -columns.exclusive[:, None], where=ks[None, :] >= columns.end[:, None])
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
        self.page_size = columns.page_size
        self.count = len(columns.rows)
        order = np.argsort(columns.end, kind="stable")
        self.ends_sorted = columns.end[order]
        self.exclusive_by_end = columns.exclusive[order]
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
        if closed < 0 or not self.count:
            profile.demand_at_candidates = profile.evaluate(ks)
            return profile
        index = self._old_index(columns)
        same = self._unchanged(columns, index, closed)
        changed_new = np.flatnonzero(~same)
        changed_old = np.ones(self.count, dtype=bool)
        changed_old[index[same]] = False
        changed_old_count = int(changed_old.sum())
        if len(changed_new) + changed_old_count >= max(len(same), 1):
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
            if changed_old_count:
                before = self.columns.subset(np.flatnonzero(changed_old), closed)
                demand[known] -= demand_of(before, kept)
            if len(changed_new):
                demand[known] += demand_of(columns.subset(changed_new), kept)
        if not known.all():
            demand[~known] = profile.evaluate(ks[~known])
        profile.demand_at_candidates = demand
        return profile

    def _old_index(self, columns: Columns) -> Steps:
        """Per request of `columns`, its index here, or -1 if it was not running then."""
        if columns.rids == self.columns.rids:
            return np.arange(len(columns.rids), dtype=np.int64)
        position = {rid: i for i, rid in enumerate(self.columns.rids)}
        return np.array([position.get(rid, -1) for rid in columns.rids], dtype=np.int64)

    def _unchanged(self, columns: Columns, index: Steps, closed: int) -> npt.NDArray[np.bool_]:
        """Per request of `columns` (`index`: where it sits here, -1 if it was not running),
        whether its term at every step k is its term here at k + closed. So it was: running,
        decoding unless no step closed (a prefill's growth starts at the next step, so its curve
        moves with the clock), with the same held, exclusive and labels, its finish `closed`
        steps closer, and per label `advance` tokens per step closed further."""
        old = self.columns
        was = np.maximum(index, 0)
        end = old.end[was]
        same = (
            (index >= 0)
            & (columns.rows == old.rows[was])
            & (columns.held == old.held[was])
            & (columns.exclusive == old.exclusive[was])
            & (columns.end == np.where(end >= NEVER, end, end - closed))
            & (columns.offset == old.offset[was])
        )
        if closed:
            same &= columns.offset == 1
        if not len(same):
            return same
        # Each request's rows here, by its label count now: a name reused with other labels
        # reads whatever rows sit there (clipped), and `same` is already False for it.
        rows = was
        if not columns.single_label:
            within = np.arange(len(columns.tokens)) - np.repeat(columns.row_starts, columns.rows)
            rows = np.repeat(old.row_starts[was], columns.rows) + within
        rows = np.minimum(rows, len(old.tokens) - 1)
        per_output = old.per_output[rows]
        same_rows = (
            (columns.per_output == per_output)
            & (columns.worst == old.worst[rows])
            & (columns.tokens == old.tokens[rows] + per_output * (self.pace.advance * closed))
        )
        if not columns.single_label:
            same_rows = np.logical_and.reduceat(same_rows, columns.row_starts)
        return same & same_rows  # type: ignore[no-any-return]

    def evaluate(self, ks: Steps) -> Steps:
        """Extra demand at any steps `ks`: O(requests x len(ks))."""
        return demand_of(self.columns, ks)

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
        """(highest extra demand, the step it is reached)."""
        i = int(np.argmax(self.demand_at_candidates))
        return int(self.demand_at_candidates[i]), int(self.candidates[i])
