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

The class is put together from mixins, one idea each, over one set of fields
(kvbank.ledger_state): the argument and invariant checks (kvbank.ledger_checks), the peak-fit
hooks and deferred admissions (kvbank.ledger_peak) and EASY backfill (kvbank.ledger_backfill).
This module keeps arrivals, admission and the running requests' page counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvbank.capacity import SINK_PAGES
from kvbank.ledger_backfill import Backfill
from kvbank.ledger_peak import hold_of
from kvbank.ledger_state import Waiting
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
from kvbank.peakfit import PeakShape

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

_D = TypeVar("_D", Admitted, Refused)


@dataclass
class Ledger(Backfill):
    """FIFO, head-only admission against running totals. `debug` checks the safe-state invariant
    after every change (tests run with it on).

    With a `policy`, the ledger also keeps each running request's progress (a timeline) and
    admits the head when the peak of the timeline fits rather than the sum of worst cases
    (`policy.peak`), and lets a later request start past a blocked head when that cannot delay
    the head's promised step (`policy.backfill`). The conservative test is tried first: what it
    admits, the peak test admits too."""

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
        self._waiting[rid] = Waiting(pages, shape)
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

    def _fits(self, waiting: Waiting, hit: Hit) -> bool:
        need = waiting.pages - hit.pages
        if self._outstanding + need <= self.supply - hit.idle_pages:
            return True
        timeline = self._timeline
        if timeline is None or not timeline.peak_active:
            return False
        return timeline.fits(self._shape(waiting), hold_of(hit), self.supply)

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
            self._timeline.add(rid, waiting.shape, pages, hold_of(hit), deferred=self._deferring)
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
                for later, hit in self._backfill(rid, peek):
                    admitted.append(self._admit(later, hit))
                    if started is not None:
                        started(admitted[-1])
            return admitted
        finally:
            self._deferring = False

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

    # ---- running requests (their progress: kvbank.ledger_peak) --------------------------------

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

    # ---- helpers -------------------------------------------------------------------------------

    def _take_supply(self, pages: int) -> None:
        from_free = min(pages, self.free)
        self.free -= from_free
        self.evictable -= pages - from_free

    def _decide(self, decision: _D) -> _D:
        self.next_seq += 1
        self._after_change()
        return decision
