"""The ledger's timeline of running requests: their progress, the peak-fit test and the EASY
backfill promise. A ledger with a `PeakPolicy` holds one; without, the trivial one of
kvbank/ledger/conservative.py. Cost: a test reads the cached profile and evaluates the newcomer
at its candidate steps (one numpy pass); the profile is brought up to date once after a change,
from the previous one (kvbank/ledger/profile.py), so a run of checks between steps pays it once.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from kvbank.ledger.books import Books, Waiting
from kvbank.ledger.policy import PeakPolicy
from kvbank.ledger.profile import Profile
from kvbank.ledger.shape import (
    NEVER,
    Pace,
    PeakShape,
    Steps,
    Track,
    flat_shape,
    give_back_problem,
    newcomer,
    newcomer_at,
    open_ended,
    steps_for,
    track_for,
)
from kvbank.ledger.types import NO_HIT, Hit, InvalidPages, InvariantBreach

log = logging.getLogger(__name__)


class Timeline:
    """The running requests' progress, step by step, under a `PeakPolicy`."""

    def __init__(self, policy: PeakPolicy):
        self.policy: PeakPolicy | None = policy
        self.peak_policy = policy
        self.pace = Pace.of(policy.speculative_tokens, policy.max_advance)
        self.tracks: dict[str, Track] = {}
        self.stalled_steps = 0  # steps in which a running request did not advance
        self.fallback = False  # admit conservatively until every request advances again
        self.pending_return = 0  # exclusive pages released but not yet in a supply report
        self.clock = 0  # steps closed so far
        self._promise: tuple[str, int] | None = None  # (head, the step it is promised by)
        self._profile: Profile | None = None
        self._followed: Profile | None = None  # the latest profile built; the next follows it
        # Admitted but not yet started by the engine (a decision on its way to a remote engine):
        # the shape it will run with. Until it starts its track has no finish (see `add`).
        self.unstarted: dict[str, PeakShape] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> Timeline:
        """A ledger's all-or-nothing copy: each track copied, the immutable profile shared."""
        twin = copy.copy(self)
        twin.tracks = {rid: replace(t, tokens=list(t.tokens)) for rid, t in self.tracks.items()}
        twin.unstarted = dict(self.unstarted)
        return twin

    def copy(self) -> Timeline:
        return copy.deepcopy(self)

    @property
    def peak_active(self) -> bool:
        return self.peak_policy.peak and not self.fallback

    @property
    def backfill(self) -> bool:
        return self.peak_policy.backfill

    @property
    def backfill_depth(self) -> int:
        return self.peak_policy.backfill_depth

    def shape_of(self, waiting: Waiting, deferred: bool) -> PeakShape:
        """A waiting request as the tests read it: its shape (open-ended when the engine starts
        it later, `deferred`), or its worst case when it came without one."""
        if waiting.shape is None:
            return flat_shape(waiting.pages, self.peak_policy.page_size)
        return open_ended(waiting.shape) if deferred else waiting.shape

    def check(self, books: Books, between_steps: bool) -> None:
        """Raise InvariantBreach unless the promises fit the supply. A peak-fit reading holds
        only between steps (mid-step, some requests' tracks still start a step behind), so it is
        checked only then."""
        if not self.peak_policy.peak:
            books.check_conservative()
            return
        if not between_steps:
            return
        # Pages released but not yet reported back by the pool still count as supply.
        supply = books.supply + self.pending_return
        highest, step = self.peak()
        if highest > supply:
            raise InvariantBreach(
                f"the running requests may need {highest} more pages at step {step} from now "
                f"but supply is {supply} (free {books.free} + evictable {books.evictable} + "
                f"{self.pending_return} released, not yet reported)"
            )

    def headroom(self, books: Books) -> int:
        """Pages the pool could lose now with every promise kept (see Ledger.headroom)."""
        if not self.peak_policy.peak:
            return books.supply - books.outstanding
        highest, _ = self.peak()
        return books.supply + self.pending_return - highest

    def profile(self) -> Profile:
        if self._profile is None:
            if self._followed is None:
                self._profile = Profile(
                    self.tracks, self.peak_policy.page_size, self.pace, self.clock
                )
            else:
                self._profile = self._followed.follow(self.tracks, self.clock)
            self._followed = self._profile
        return self._profile

    def _changed(self) -> None:
        self._profile = None

    # ---- membership ----------------------------------------------------------------------------

    def add(
        self, rid: str, shape: PeakShape | None, reserved: int, hit: Hit, deferred: bool = False
    ) -> None:
        """An admitted request. The sole-held part of its hit was exclusive to some running
        holder, which no longer returns it when it finishes. The ledger is not told which
        holder, and requests finish in any order (earlier than their bound), so every running
        request stops counting that many of its pages as returning: never more than the truth,
        whoever finishes first. The pool's next exact count (advance's `exclusive`) undoes
        the excess.

        `deferred`: the engine starts it when the decision reaches it, some steps from now, so
        until `start` its track is `open_ended` (it may start at any later step)."""
        self._pin(hit.sole)
        if shape is None:
            flat = flat_shape(reserved, self.peak_policy.page_size)
            self.tracks[rid] = track_for(flat, hit.pages, hit.idle_pages, False)
        else:
            if deferred:
                self.unstarted[rid] = shape
                shape = open_ended(shape)
            track = track_for(shape, hit.pages, hit.idle_pages, self.peak_policy.peak)
            self.tracks[rid] = track
        self._changed()

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a deferred admission, with `prefill_chunks` its worst-case
        prefill steps from now (they depend on the prefill queued ahead of it then). Its
        open-ended track becomes the usual one: a curve that starts now lies under the open
        end's at every step, so nothing promised before can break. A request that was not
        deferred (restored, or admitted without a shape) keeps its flat track."""
        track = self.tracks[rid]
        if rid not in self.unstarted and track.budget != NEVER:
            raise InvalidPages(
                f"request {rid!r} was started already (or admitted for an engine that starts "
                f"what it is told at once); report start only for deferred admissions"
            )
        shape = self.unstarted.pop(rid, None)
        if shape is None:
            return
        shape = replace(shape, prefill_chunks=prefill_chunks)
        started = track_for(shape, track.held, track.exclusive, self.peak_policy.peak)
        self.tracks[rid] = started
        self._changed()

    def is_unstarted(self, rid: str) -> bool:
        return rid in self.unstarted

    def set_exclusive(self, rid: str, exclusive: int) -> None:
        """The pool's exact count of a running request's pages no one else holds (a pin or a
        lease made some of them shared), between progress reports."""
        self.tracks[rid].exclusive = exclusive
        self._changed()

    def restore(self, rid: str, reserved: int, held: int) -> None:
        """A request re-registered after a restart: worst case until released, and none of
        its pages counted as returning (which of them are shared is not known)."""
        flat = flat_shape(reserved, self.peak_policy.page_size)
        self.tracks[rid] = track_for(flat, held, 0, False)
        self._changed()

    def remove(self, rid: str) -> None:
        self.unstarted.pop(rid, None)
        track = self.tracks.pop(rid)
        self.pending_return += track.exclusive
        self._changed()

    def supply_reported(self) -> None:
        self.pending_return = 0

    def _pin(self, shared: int) -> None:
        if shared:
            for track in self.tracks.values():
                track.exclusive = max(0, track.exclusive - shared)

    # ---- progress ------------------------------------------------------------------------------

    def take(self, rid: str, pages: int) -> None:
        track = self.tracks[rid]
        track.held += pages
        track.exclusive += pages  # pages a request allocates are its own until shared
        self._changed()

    def check_advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None,
        chunks_left: int,
        exclusive: int | None,
    ) -> str | None:
        """What is wrong with this progress report, or None."""
        track = self.tracks[rid]
        if track.budget == NEVER:
            return None
        if not track.produced <= produced <= track.budget:
            return (
                f"request {rid!r} reports {produced} output tokens; it had {track.produced} "
                f"and may produce at most {track.budget}"
            )
        if not 0 <= chunks_left <= track.chunks:
            return (
                f"request {rid!r} reports {chunks_left} prefill chunks left; it had "
                f"{track.chunks} (its worst case), and a count never rises"
            )
        if exclusive is not None and not 0 <= exclusive <= track.held:
            return f"request {rid!r} reports {exclusive} exclusive pages of its {track.held}"
        if tokens_per_label is not None:
            if set(tokens_per_label) != set(track.labels):
                return (
                    f"request {rid!r} reports labels {sorted(tokens_per_label)}; it writes "
                    f"{sorted(track.labels)}"
                )
            for label, worst in zip(track.labels, track.worst, strict=True):
                if not 0 <= tokens_per_label[label] <= worst:
                    return (
                        f"request {rid!r} reports {tokens_per_label[label]} tokens in label "
                        f"{label!r}; its worst case there is {worst}"
                    )
        return None

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None,
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        """Record progress (checked by check_advance first). Tokens per label default to what
        the output count implies; a label never counts below its prompt, whose pages the first
        prefill chunk took whole."""
        track = self.tracks[rid]
        track.moved = True
        if exclusive is not None:
            track.exclusive = exclusive
        if track.budget != NEVER:
            track.produced, track.chunks = produced, chunks_left
            track.remaining = track.budget - produced
            if self.peak_policy.peak:
                for i, label in enumerate(track.labels):
                    implied = track.base[i] + track.per_output[i] * produced
                    told = tokens_per_label[label] if tokens_per_label else implied
                    track.tokens[i] = min(track.worst[i], max(told, track.base[i]))
        self._changed()

    def end_step(self) -> list[str]:
        """Close a step: every running request must have advanced in it. If one did not, the
        timeline's bound no longer holds for it: say so, count it, and admit conservatively
        until a step in which every request advances."""
        stalled = [rid for rid, t in self.tracks.items() if not t.moved and t.budget != NEVER]
        for track in self.tracks.values():
            track.moved = False
            track.step_produced = track.produced
        self.clock += 1
        if stalled:
            self.stalled_steps += 1
            if not self.fallback:
                log.warning(
                    "%d running request(s) did not advance this step (%s); admitting "
                    "conservatively until every running request advances each step",
                    len(stalled),
                    ", ".join(stalled[:5]),
                )
            self.fallback = True
        elif self.fallback:
            log.warning("every running request advanced again; peak-fit admission resumes")
            self.fallback = False
        self._changed()
        return stalled

    def check_give_back(self, rid: str, shape: PeakShape | None) -> str | None:
        """What is wrong with the curve a request giving pages back would follow (None: the
        same labels, never above its curve now)."""
        return give_back_problem(self.tracks[rid], rid, shape, self.peak_policy.peak)

    def give_back(self, rid: str, held: int, shape: PeakShape | None) -> None:
        """The freed pages are no longer the request's; from its progress so far it follows
        `shape` (at most the freed pages less at every step), so its demand does not rise."""
        track = self.tracks[rid]
        track.held -= held
        track.exclusive = max(0, track.exclusive - held)
        if shape is not None and track.budget != NEVER:
            track.worst, track.base = shape.worst, shape.base
            if self.peak_policy.peak:
                track.per_output = shape.per_output
                track.tokens = [min(t, w) for t, w in zip(track.tokens, shape.worst, strict=True)]
            else:
                track.tokens = list(shape.worst)
        self._changed()  # the profile is stale

    # ---- the tests -----------------------------------------------------------------------------

    def fits(self, shape: PeakShape, hit: Hit, supply: int) -> bool:
        """Whether the newcomer, started now with `hit`, keeps the peak within supply. The
        running requests' peak plus its demand at that step is one of the sums `_highest` takes
        the maximum of: when that is over, the answer is no (most refusals on a full pool)."""
        if self.over_at_peak(shape, hit, supply):
            return False
        return self._highest(shape, 0, hit, None) <= supply - hit.idle_pages

    def over_at_peak(self, shape: PeakShape, hit: Hit, supply: int) -> bool:
        """`fits`' first test: only the hit's held part counts (`backfill.refuses`)."""
        highest, step = self.peak()
        at_peak = newcomer_at(shape, self.pace, self.peak_policy.page_size, step, hit.pages,
                              hit.idle_pages, self.peak_active)  # fmt: skip
        return highest + at_peak > supply - hit.idle_pages

    def promise(self, rid: str, head: PeakShape, supply: int) -> int | None:
        """Steps from now until the head surely fits, counting no cached hit for it (a hit only
        helps), or None if none is in sight. Tried now, at the step the head was promised
        before (which still holds: the timeline only improves as requests advance) and at each
        finish; the earliest that fits is kept as the new promise."""
        profile = self.profile()
        starts = {0, *(int(s) for s in profile.finishes)}
        if self._promise is not None and self._promise[0] == rid:
            starts.add(max(0, self._promise[1] - self.clock))
        for start in sorted(starts):
            if self._highest(head, start, NO_HIT, None) <= supply:
                self._promise = (rid, self.clock + start)
                return start
        self._promise = None
        return None

    def fits_behind(
        self, head: PeakShape, start: int, shape: PeakShape, hit: Hit, supply: int
    ) -> bool:
        """Whether the newcomer may start now without delaying the head promised `start`."""
        if not self.fits(shape, hit, supply):
            return False
        return self._highest(head, start, NO_HIT, (shape, hit)) <= supply - hit.idle_pages

    def _highest(
        self,
        shape: PeakShape,
        start: int,
        hit: Hit,
        beside: tuple[PeakShape, Hit] | None,
    ) -> int:
        """Highest extra demand with the newcomer started at `start` (and, if given, another
        request started now beside the running ones)."""
        profile = self.profile()
        candidates, demand = profile.candidates, profile.demand_at_candidates
        if start:
            later = candidates >= start
            candidates, demand = candidates[later], demand[later]
        # The newcomers' own steps (start, the step before a finish, after it) are evaluated
        # afresh; duplicates of candidates are harmless.
        extra = steps_for(shape, start)
        if beside is not None:
            extra = np.concatenate([extra, steps_for(beside[0], 0)])
            extra = extra[extra >= start]
        ks = np.concatenate([candidates, extra])
        total = np.concatenate([demand, profile.evaluate(extra)])
        total += self._newcomer(shape, ks, start, hit)
        shared = hit.sole
        if beside is not None:
            other, other_hit = beside
            total += self._newcomer(other, ks, 0, other_hit)
            shared += other_hit.sole
        if shared:
            total += profile.returned(ks) - profile.returned(ks, pinned=shared)
        return int(total.max())

    def _newcomer(self, shape: PeakShape, ks: Steps, start: int, hit: Hit) -> Steps:
        page_size = self.peak_policy.page_size
        return newcomer(
            shape, self.pace, page_size, ks, start, hit.pages, hit.idle_pages, self.peak_active
        )

    def peak(self) -> tuple[int, int]:
        """(highest extra demand of the running requests, the step it is reached)."""
        return self.profile().peak()
