"""The reservation ledger: the banker's algorithm with one resource, KV pages (conservative form).

A request is admitted only if every admitted request, itself included, can still get every page
it may need at the same time: they decode together, so they must all be able to finish together.

State is kept as running totals so that admission is one comparison:

    outstanding = sum(reserved - held)     pages admitted requests may still take
    supply      = free + evictable         pages the pool can still hand out

and a head with cached hit `hit` (of which `idle` pages only the index holds) is admitted when

    outstanding + (reserved - hit) <= supply - idle

because leasing the idle part takes it out of the evictable supply. The ledger is pure Python and
does no I/O: the engine (or the sidecar on its behalf) reports what the pool did.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kvbank.capacity import SINK_PAGES
from kvbank.ledger_types import (
    NO_HIT,
    Admitted,
    Decision,
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    LedgerError,
    LedgerSnapshot,
    NotAdmissible,
    Refused,
    Reservation,
    UnknownRequest,
)
from kvbank.peakfit import NEVER, PeakShape, flat_shape
from kvbank.peaktimeline import Hold, PeakPolicy, Timeline, open_ended

__all__ = [
    "NO_HIT",
    "Admitted",
    "Decision",
    "DuplicateRequest",
    "Hit",
    "InvalidPages",
    "InvariantBreach",
    "Ledger",
    "LedgerError",
    "LedgerSnapshot",
    "NotAdmissible",
    "Refused",
    "Reservation",
    "UnknownRequest",
]


def _hold(hit: Hit) -> Hold:
    held = hit.pages - hit.idle_pages
    sole = held if hit.sole_pages is None else min(held, hit.sole_pages)
    return Hold(hit.pages, hit.idle_pages, sole)


_D = TypeVar("_D", Admitted, Refused)


@dataclass
class _Waiting:
    pages: int
    shape: PeakShape | None = None


@dataclass
class Ledger:
    """FIFO, head-only admission against running totals. `debug` checks the safe-state invariant
    after every change (tests run with it on).

    With a `policy`, the ledger also keeps each running request's progress (a timeline) and
    admits the head when the peak of the timeline fits rather than the sum of worst cases
    (`policy.peak`), and lets a later request start past a blocked head when that cannot delay
    the head's promised step (`policy.backfill`). The conservative test is tried first: what it
    admits, the peak test admits too."""

    total_pages: int
    debug: bool = False
    free: int = -1  # -1: every usable page starts free
    evictable: int = 0
    next_seq: int = 0
    _waiting: OrderedDict[str, _Waiting] = field(default_factory=OrderedDict, repr=False)
    _running: dict[str, Reservation] = field(default_factory=dict, repr=False)
    _outstanding: int = 0
    policy: PeakPolicy | None = None
    # The last backfill promise: (head, steps from the pass that made it), None when none holds.
    promised: tuple[str, int] | None = None
    _timeline: Timeline | None = field(default=None, init=False, repr=False)
    # Set while admit_ready decides for an engine that starts its admissions later (deferred).
    _deferring: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy is not None:
            self._timeline = Timeline(self.policy)
        if self.total_pages <= SINK_PAGES:
            raise InvalidPages(
                f"a pool needs at least {SINK_PAGES + 1} pages, got {self.total_pages}"
            )
        if self.free < 0:
            self.free = self.usable_pages

    # ---- read side -----------------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        return self.total_pages - SINK_PAGES

    @property
    def supply(self) -> int:
        return self.free + self.evictable

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def head(self) -> str | None:
        return next(iter(self._waiting), None)

    def waiting_count(self) -> int:
        return len(self._waiting)

    def is_waiting(self, rid: str) -> bool:
        return rid in self._waiting

    def reservation(self, rid: str) -> Reservation:
        try:
            return self._running[rid]
        except KeyError:
            raise UnknownRequest(f"request {rid!r} is not running") from None

    def running(self) -> list[Reservation]:
        return list(self._running.values())

    def snapshot(self) -> LedgerSnapshot:
        running = tuple(
            Reservation(r.rid, r.reserved, r.held, r.seq) for r in self._running.values()
        )
        return LedgerSnapshot(
            total_pages=self.total_pages,
            usable_pages=self.usable_pages,
            free=self.free,
            evictable=self.evictable,
            outstanding=self._outstanding,
            reserved=sum(r.reserved for r in running),
            held=sum(r.held for r in running),
            waiting=tuple((rid, w.pages) for rid, w in self._waiting.items()),
            running=running,
            next_seq=self.next_seq,
        )

    def copy(self) -> Ledger:
        """An independent ledger in the same state: a caller that applies a batch of changes
        all-or-nothing keeps one to go back to. Costs O(waiting + running)."""
        twin = replace(
            self,
            _waiting=OrderedDict(
                (rid, _Waiting(w.pages, w.shape)) for rid, w in self._waiting.items()
            ),
            _running={
                rid: Reservation(r.rid, r.reserved, r.held, r.seq)
                for rid, r in self._running.items()
            },
        )
        twin._timeline = copy.deepcopy(self._timeline)
        return twin

    # ---- arrivals ------------------------------------------------------------------------------

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> Refused | None:
        """Queue a request whose worst case is `pages`. One the pool can never hold is refused
        at once (never queued), with `refusal` as its message when the caller has a better one.
        `shape` (kvbank.peakfit.peak_shape) lets a policy ledger follow its progress; without
        it the request counts at its worst case until released."""
        self._check_new(rid)
        self._check_pages(pages, "pages", bounded=False)
        if shape is not None and shape.pages != pages:
            raise InvalidPages(
                f"request {rid!r}: its shape counts {shape.pages} worst-case pages but "
                f"{pages} were given; build both from the same count_pages"
            )
        if pages > self.usable_pages:
            message = refusal or (
                f"this request needs {pages} KV pages but the pool holds {self.usable_pages} "
                f"pages for requests; lower max_tokens or raise the pool to at least "
                f"{pages + SINK_PAGES} pages"
            )
            return self._decide(Refused(rid, self.next_seq, message))
        self._waiting[rid] = _Waiting(pages, shape)
        return None

    def shape(self, rid: str) -> PeakShape | None:
        """The shape a waiting request was submitted with (None: none was given)."""
        waiting = self._waiting.get(rid)
        if waiting is None:
            raise UnknownRequest(f"request {rid!r} is not waiting")
        return waiting.shape

    def set_shape(self, rid: str, shape: PeakShape) -> None:
        """Replace a waiting request's shape (its prefill bound depends on the queue ahead of
        it when it is admitted). The worst-case pages must stay the same."""
        waiting = self._waiting.get(rid)
        if waiting is None:
            raise UnknownRequest(f"request {rid!r} is not waiting")
        if shape.pages != waiting.pages:
            raise InvalidPages(
                f"request {rid!r}: the new shape counts {shape.pages} worst-case pages but it "
                f"was submitted with {waiting.pages}"
            )
        waiting.shape = shape

    def cancel(self, rid: str) -> None:
        """Drop a waiting request (its client went away before admission)."""
        if self._waiting.pop(rid, None) is None:
            raise UnknownRequest(f"request {rid!r} is not waiting")

    # ---- admission -----------------------------------------------------------------------------

    def can_admit_head(self, hit: Hit = NO_HIT) -> bool:
        rid = self.head
        if rid is None:
            return False
        return self._fits(self._waiting[rid], hit)

    def _fits(self, waiting: _Waiting, hit: Hit) -> bool:
        need = waiting.pages - hit.pages
        if self._outstanding + need <= self.supply - hit.idle_pages:
            return True
        timeline = self._timeline
        if timeline is None or not timeline.peak_active:
            return False
        return timeline.fits(self._shape(waiting), _hold(hit), self.supply)

    def _shape(self, waiting: _Waiting) -> PeakShape:
        assert self.policy is not None
        if waiting.shape is None:
            return flat_shape(waiting.pages, self.policy.page_size)
        return open_ended(waiting.shape) if self._deferring else waiting.shape

    def admit_head(self, hit: Hit = NO_HIT) -> Admitted:
        """Admit the head, leasing its cached hit. Raises NotAdmissible when it does not fit."""
        rid = self.head
        if rid is None:
            raise NotAdmissible("no request is waiting")
        pages = self._waiting[rid].pages
        self._check_hit(hit, pages)
        if not self.can_admit_head(hit):
            raise NotAdmissible(
                f"request {rid!r} needs {pages - hit.pages} pages beyond its {hit.pages}-page "
                f"hit; outstanding {self._outstanding} + that exceeds supply {self.supply} - "
                f"{hit.idle_pages} leased idle pages"
            )
        return self._admit(rid, hit)

    def _admit(self, rid: str, hit: Hit) -> Admitted:
        waiting = self._waiting.pop(rid)
        pages = waiting.pages
        self._running[rid] = Reservation(rid, pages, hit.pages, self.next_seq)
        self._outstanding += pages - hit.pages
        self.evictable -= hit.idle_pages  # the lease takes idle cached pages off the supply
        if self._timeline is not None:
            self._timeline.add(rid, waiting.shape, pages, _hold(hit), deferred=self._deferring)
        return self._decide(Admitted(rid, self.next_seq, pages, hit))

    def admit_ready(
        self,
        peek: Callable[[str], Hit | None] = lambda rid: NO_HIT,
        started: Callable[[Admitted], None] | None = None,
        deferred: bool = False,
    ) -> list[Admitted]:
        """Admit heads in FIFO order while they fit. `peek(rid)` recomputes the head's hit each
        time it is tried, without touching the prefix index's LRU; it returns None when the
        caller cannot tell that head's hit (a remote engine reported hits for the first few
        waiting requests only), which stops admission there. `started(decision)` runs after
        each admission, before the next peek, so the caller can lease that request's hit first.

        `deferred`: the engine reads these decisions later (a sidecar's engine that does not
        wait) and starts each at a step the ledger cannot know; with a policy, each is tested
        and kept open-ended (kvbank.peaktimeline.open_ended) until the engine reports `start`."""
        self._deferring = deferred
        try:
            admitted = []
            while (rid := self.head) is not None:
                hit = peek(rid)
                if hit is None or not self.can_admit_head(hit):
                    break
                admitted.append(self.admit_head(hit))
                if started is not None:
                    started(admitted[-1])
            self.promised = None
            if rid is not None and self.policy is not None and self.policy.backfill:
                admitted.extend(self._backfill(rid, peek, started))
            return admitted
        finally:
            self._deferring = False

    def _backfill(
        self,
        head: str,
        peek: Callable[[str], Hit | None],
        started: Callable[[Admitted], None] | None,
    ) -> list[Admitted]:
        """EASY backfill: find the earliest step the blocked head surely fits, then let up to
        `backfill_depth` later requests start now, each only if the head still fits at that
        step beside it. The head is never delayed, so nothing starves."""
        timeline, policy = self._timeline, self.policy
        assert timeline is not None and policy is not None
        if timeline.fallback or len(self._waiting) < 2:
            return []
        head_shape = self._shape(self._waiting[head])
        start = timeline.promise(head, head_shape, self.supply)
        if start is None:
            return []
        self.promised = (head, start)
        admitted = []
        for rid in list(self._waiting)[1 : 1 + policy.backfill_depth]:
            waiting, hit = self._waiting[rid], peek(rid)
            if hit is None:
                break  # the caller cannot tell hits this far down the queue
            try:
                self._check_hit(hit, waiting.pages)
            except InvalidPages:
                continue  # a stale peek; the request waits for its turn
            hold = _hold(hit)
            if timeline.fits_behind(head_shape, start, self._shape(waiting), hold, self.supply):
                admitted.append(self._admit(rid, hit))
                if started is not None:
                    started(admitted[-1])
        return admitted

    def restore(self, rid: str, reserved: int, held: int) -> Reservation:
        """Re-register a request that was admitted before this ledger existed (a sidecar that
        restarted). It is not re-decided: the pages were promised already."""
        self._check_new(rid)
        self._check_pages(reserved, "reserved")
        self._check_pages(held, "held")
        if held > reserved:
            raise InvalidPages(f"request {rid!r} holds {held} pages but reserved {reserved}")
        res = Reservation(rid, reserved, held, self.next_seq)
        self._running[rid] = res
        self._outstanding += reserved - held
        if self._timeline is not None:
            self._timeline.restore(rid, reserved, held)
        self.next_seq += 1
        self._after_change()
        return res

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a request admitted with `deferred`; `prefill_chunks` is its
        worst-case prefill steps from now. A request the ledger does not follow step by step
        (no policy, no shape, restored) needs no start: the call only checks that it runs."""
        self.reservation(rid)
        self._check_pages(prefill_chunks, "prefill_chunks", bounded=False)
        timeline = self._timeline
        if timeline is None:
            return
        track = timeline.tracks[rid]
        if not timeline.is_unstarted(rid) and track.budget != NEVER:
            raise InvalidPages(
                f"request {rid!r} was started already (or admitted for an engine that starts "
                f"what it is told at once); report start only for deferred admissions"
            )
        timeline.start(rid, prefill_chunks)
        self._after_change()

    def set_exclusive(self, rid: str, exclusive: int) -> None:
        """A running request's pages no one else holds, counted by the pool after a pin or a
        lease shared some of them (a progress report carries the same count each step)."""
        res = self.reservation(rid)
        if isinstance(exclusive, bool) or not isinstance(exclusive, int):
            raise InvalidPages(f"exclusive must be an integer, got {exclusive!r}")
        if not 0 <= exclusive <= res.held:
            raise InvalidPages(
                f"request {rid!r} reports {exclusive} exclusive pages of the {res.held} it holds"
            )
        if self._timeline is not None:
            self._timeline.set_exclusive(rid, exclusive)
            self._after_change()

    @property
    def headroom(self) -> int:
        """Pages the pool could lose now (to a pin) with every admitted request still able to
        get every page it may need: supply minus the conservative outstanding, or, with a
        peak-fit policy, minus the timeline's highest extra demand."""
        timeline, policy = self._timeline, self.policy
        if timeline is None or policy is None or not policy.peak:
            return self.supply - self._outstanding
        highest, _ = timeline.peak()
        return self.supply + timeline.pending_return - highest

    # ---- running requests ----------------------------------------------------------------------

    def take(self, rid: str, pages: int) -> None:
        """A running request allocated `pages` new pages (from free, or by evicting idle ones)."""
        res = self.reservation(rid)
        self._check_pages(pages, "pages")
        if res.held + pages > res.reserved:
            raise InvalidPages(
                f"request {rid!r} would hold {res.held + pages} pages but reserved "
                f"{res.reserved}; it may take at most {res.reserved - res.held} more"
            )
        res.held += pages
        self._outstanding -= pages
        self._take_supply(pages)
        if self._timeline is not None:
            self._timeline.take(rid, pages)
        self._after_change()

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None = None,
        chunks_left: int = 0,
        exclusive: int | None = None,
    ) -> None:
        """A running request's progress after a step: output tokens produced so far, tokens
        written per label (default: what `produced` implies), worst-case prefill chunks still
        to run, and, when the pool knows it, how many of its held pages no other request
        holds. A ledger without a policy only checks that the request runs."""
        self.reservation(rid)
        if self._timeline is None:
            return
        problem = self._timeline.check_advance(
            rid, produced, tokens_per_label, chunks_left, exclusive
        )
        if problem is not None:
            raise InvalidPages(problem)
        self._timeline.advance(rid, produced, tokens_per_label, chunks_left, exclusive)
        self._after_change()

    def end_step(self) -> list[str]:
        """Close a step; returns the running requests that did not advance in it (then the
        ledger admits conservatively until a step in which all of them advance)."""
        if self._timeline is None:
            return []
        stalled = self._timeline.end_step()
        if self.debug:
            self.check_integrity()
        return stalled

    @property
    def stalled_steps(self) -> int:
        """Steps in which some running request did not advance (peak-fit's assumption broke)."""
        return 0 if self._timeline is None else self._timeline.stalled_steps

    def release(self, rid: str) -> Reservation:
        """A running request finished or was aborted: its unused promise is returned. The pages
        it held come back through `set_supply`, since only the pool knows which stay shared."""
        res = self._running.pop(rid, None)
        if res is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        self._outstanding -= res.reserved - res.held
        if self._timeline is not None:
            self._timeline.remove(rid)
        self._after_change()
        return res

    def set_supply(self, free: int, evictable: int) -> None:
        """The pool's own count of free pages and of cached pages eviction can reach."""
        self._check_pages(free, "free")
        self._check_pages(evictable, "evictable")
        if free + evictable > self.usable_pages:
            raise InvalidPages(
                f"free {free} + evictable {evictable} exceeds the pool's "
                f"{self.usable_pages} usable pages"
            )
        self.free, self.evictable = free, evictable
        if self._timeline is not None:
            self._timeline.supply_reported()
        self._after_change()

    # ---- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise InvariantBreach, with the numbers, unless the state is safe. With a peak
        policy, call it between steps (after every running request's advance): mid-step, some
        requests' timelines still start a step behind."""
        self._check(peak=True)

    def _check(self, peak: bool) -> None:
        total = 0
        for res in self._running.values():
            if res.held > res.reserved:
                raise InvariantBreach(
                    f"request {res.rid!r} holds {res.held} pages but reserved {res.reserved}"
                )
            total += res.reserved - res.held
        if total != self._outstanding:
            raise InvariantBreach(
                f"outstanding total {self._outstanding} != sum of reserved - held {total}"
            )
        timeline = self._timeline
        if timeline is not None and self.policy is not None and self.policy.peak:
            if not peak:
                return
            # Pages released but not yet reported back by the pool still count as supply.
            supply = self.supply + timeline.pending_return
            highest, step = timeline.peak()
            if highest > supply:
                raise InvariantBreach(
                    f"the running requests may need {highest} more pages at step {step} from now "
                    f"but supply is {supply} (free {self.free} + evictable {self.evictable} + "
                    f"{timeline.pending_return} released, not yet reported)"
                )
        elif self._outstanding > self.supply:
            worst = max(self._running.values(), key=lambda r: r.reserved - r.held, default=None)
            raise InvariantBreach(
                f"outstanding {self._outstanding} pages exceed supply {self.supply} (free "
                f"{self.free} + evictable {self.evictable}); largest claim: "
                f"{worst.rid if worst else '-'!r} with "
                f"{(worst.reserved - worst.held) if worst else 0} pages still to take"
            )

    # ---- helpers -------------------------------------------------------------------------------

    def _take_supply(self, pages: int) -> None:
        from_free = min(pages, self.free)
        self.free -= from_free
        self.evictable -= pages - from_free

    def _decide(self, decision: _D) -> _D:
        self.next_seq += 1
        self._after_change()
        return decision

    def _after_change(self) -> None:
        if self.debug:
            self._check(peak=False)

    def _check_new(self, rid: str) -> None:
        if not isinstance(rid, str) or not rid:
            raise InvalidPages(f"a request id must be a non-empty string, got {rid!r}")
        if rid in self._waiting or rid in self._running:
            raise DuplicateRequest(f"request {rid!r} is already known")

    def _check_pages(self, pages: int, name: str, bounded: bool = True) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise InvalidPages(f"{name} must be a non-negative integer, got {pages!r}")
        if bounded and pages > self.total_pages:
            raise InvalidPages(f"{name}={pages} exceeds the pool's {self.total_pages} pages")

    def _check_hit(self, hit: Hit, pages: int) -> None:
        if not 0 <= hit.idle_pages <= hit.pages <= pages:
            raise InvalidPages(
                f"a hit must satisfy 0 <= idle {hit.idle_pages} <= pages "
                f"{hit.pages} <= the request's {pages} pages"
            )
        if hit.sole_pages is not None and not 0 <= hit.sole_pages <= hit.pages - hit.idle_pages:
            raise InvalidPages(
                f"a hit's sole-held pages ({hit.sole_pages}) must be among its "
                f"{hit.pages - hit.idle_pages} held pages"
            )
        if hit.idle_pages > self.evictable:
            raise InvalidPages(
                f"hit leases {hit.idle_pages} idle pages but only {self.evictable} are evictable"
            )
