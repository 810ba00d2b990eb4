"""The reservation ledger: the banker's algorithm with one resource, KV pages.

A request is admitted only if every admitted request, itself included, can still get every page
it may need at the same time: they decode together, so they must all be able to finish together.

State is kept as running totals so that admission is one comparison:

    outstanding = sum(reserved - held)     pages admitted requests may still take
    supply      = free + evictable         pages the pool can still hand out

and a head with cached hit `hit` (of which `idle` pages only the index holds) is admitted when

    outstanding + (reserved - hit) <= supply - idle

because leasing the idle part takes it out of the evictable supply. Pure Python, no I/O: the
engine reports what the pool did. Parts: books.py, timeline.py (else conservative.py), backfill.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice
from typing import TypeVar

from kvbank.capacity import SINK_PAGES, refusal_message
from kvbank.ledger import backfill
from kvbank.ledger.books import Books, Waiting
from kvbank.ledger.conservative import ConservativeTimeline
from kvbank.ledger.policy import PeakPolicy
from kvbank.ledger.shape import PeakShape
from kvbank.ledger.timeline import Timeline
from kvbank.ledger.types import (
    NO_HIT,
    Admitted,
    Hit,
    InvalidPages,
    LedgerSnapshot,
    Refused,
    Reservation,
)

AnyTimeline = Timeline | ConservativeTimeline
_D = TypeVar("_D", Admitted, Refused)


class Ledger:
    """FIFO admission against running totals (`try_admit`); `debug` checks the safe-state
    invariant after every change. With a `policy` it follows each running request's progress
    and admits when the timeline's peak fits (`peak`), and lets a later request past a refused
    head that it cannot delay (`backfill`). The conservative test is tried first."""

    def __init__(
        self,
        total_pages: int,
        debug: bool = False,
        free: int = -1,
        evictable: int = 0,
        next_seq: int = 0,
        policy: PeakPolicy | None = None,
    ) -> None:
        self.timeline: AnyTimeline = ConservativeTimeline() if policy is None else Timeline(policy)
        self.books = Books(total_pages, free, evictable, next_seq)
        self.debug = debug
        # The refused head's promise while it holds: (head, steps from when it was made).
        self.promised: tuple[str, int] | None = None
        self._backfill: backfill.Promise | None = None

    def copy(self) -> Ledger:
        """An independent ledger in the same state, for a batch applied all-or-nothing."""
        twin = Ledger.__new__(Ledger)
        twin.books, twin.timeline = self.books.copy(), self.timeline.copy()
        twin.debug, twin.promised, twin._backfill = self.debug, self.promised, self._backfill
        return twin

    # ---- reading -------------------------------------------------------------------------------

    @property
    def policy(self) -> PeakPolicy | None:
        return self.timeline.policy

    @property
    def total_pages(self) -> int:
        return self.books.total_pages

    @property
    def usable_pages(self) -> int:
        return self.books.usable_pages

    @property
    def free(self) -> int:
        return self.books.free

    @property
    def evictable(self) -> int:
        return self.books.evictable

    @property
    def supply(self) -> int:
        return self.books.supply

    @property
    def outstanding(self) -> int:
        return self.books.outstanding

    @property
    def next_seq(self) -> int:
        return self.books.next_seq

    @property
    def head(self) -> str | None:
        return self.books.head

    def waiting_count(self) -> int:
        return len(self.books.waiting)

    def waiting_rids(self, first: int | None = None) -> list[str]:  # FIFO, all or the first
        return list(islice(self.books.waiting, first))

    def is_waiting(self, rid: str) -> bool:
        return rid in self.books.waiting

    def reservation(self, rid: str) -> Reservation:
        return self.books.reservation(rid)

    def running(self) -> list[Reservation]:
        return list(self.books.running.values())

    def snapshot(self) -> LedgerSnapshot:
        return self.books.snapshot()

    @property
    def headroom(self) -> int:
        """Pages the pool could lose now (to a pin) with every admitted request still able to
        get every page it may need: supply minus the conservative outstanding, or, with a
        peak-fit policy, minus the timeline's highest extra demand."""
        return self.timeline.headroom(self.books)

    @property
    def stalled_steps(self) -> int:
        """Steps in which some running request did not advance (peak-fit's assumption broke)."""
        return self.timeline.stalled_steps

    def check_integrity(self) -> None:
        """Raise InvariantBreach, with the numbers, unless the state is safe. With a peak
        policy, call it between steps (after every running request's advance): mid-step, some
        requests' timelines still start a step behind."""
        self.books.check_totals()
        self.timeline.check(self.books, between_steps=True)

    def _after_change(self) -> None:
        if self.debug:
            self.books.check_totals()
            self.timeline.check(self.books, between_steps=False)

    # ---- arrivals ------------------------------------------------------------------------------

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> Refused | None:
        """Queue a request whose worst case is `pages`. One the pool can never hold is refused
        at once (never queued), with `refusal` as its message when the caller has a better one.
        `shape` (kvbank.ledger.peak_shape) lets a policy ledger follow its progress; without
        it the request counts at its worst case until released."""
        books = self.books
        books.check_new(rid)
        books.check_pages(pages, "pages", bounded=False)
        if shape is not None:
            shape.check(rid, pages, self.policy)
        if pages > books.usable_pages:
            advice = f"lower max_tokens or raise the pool to at least {pages + SINK_PAGES} pages"
            message = refusal or refusal_message(pages, books.usable_pages, advice)
            return self._decide(Refused(rid, books.next_seq, message))
        books.waiting[rid] = Waiting(pages, shape)
        return None

    def shape(self, rid: str) -> PeakShape | None:
        """The shape a waiting request was submitted with (None: none was given)."""
        return self.books.waiting_entry(rid).shape

    def cancel(self, rid: str) -> None:
        """Drop a waiting request (its client went away before admission)."""
        self.books.waiting_entry(rid)
        if rid == self.books.head:
            self._forget_promise()
        del self.books.waiting[rid]

    # ---- admission -----------------------------------------------------------------------------

    def try_admit(
        self,
        rid: str,
        hit: Hit | None = NO_HIT,
        prefill_chunks: int | None = None,
        deferred: bool = False,
    ) -> Admitted | None:
        """Admit the waiting `rid` if it may start now, leasing its cached `hit`; None is an
        answer too: it waits, asked again later. The caller asks in the ledger's FIFO order
        (`ask_in_order`, kvbank/ledger/client.py) and starts each admission before the next.

        - The head is admitted when it fits. A refused head (with backfill) gets a promise, the
          earliest step it surely fits, held until the step ends or the head changes.
        - A request behind it is admitted only while the promise holds, among the
          `backfill_depth` that followed the head then, and only if it cannot delay that step
          (kvbank/ledger/backfill.py). A stale hit there is answered None, not an error.

        `hit=None`: the caller cannot start it this step (no room); a head asked so still gets
        its promise. `prefill_chunks`: its worst-case prefill steps if admitted now, kept in its
        shape. `deferred`: the engine starts it at a step the ledger cannot know (a sidecar's
        engine that does not wait); it stays `open_ended` until the engine reports `start`."""
        books = self.books
        waiting = books.waiting_entry(rid)
        is_head = rid == books.head
        if is_head and hit is not None:
            books.check_hit(hit, waiting.pages)  # before anything changes
        books.keep_chunks(waiting, prefill_chunks)
        if is_head:
            self._forget_promise()
            if hit is not None and self._fits(waiting, hit, deferred):
                return self._admit(rid, hit, deferred)
            self._promise(rid, deferred)
            return None
        held = self._backfill
        if hit is None or held is None or rid not in held.window:
            return None
        try:
            books.check_hit(hit, waiting.pages)
        except InvalidPages:
            return None
        shape = self.timeline.shape_of(waiting, deferred)
        if not self.timeline.fits_behind(held.shape, held.start, shape, hit, books.supply):
            return None
        return self._admit(rid, hit, deferred)

    def backfilling(self) -> bool:
        """Whether a refused head's promise holds, so a request behind it may still be admitted
        this step (`try_admit`)."""
        return self._backfill is not None

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None = None) -> bool:
        """Whether `try_admit` refuses `rid` with any hit holding at most `most_held` pages of
        running requests' (`backfill.refuses`), keeping `prefill_chunks` as `try_admit` does."""
        return backfill.refuses(self.books, self.timeline, self._backfill, rid, most_held,
                                prefill_chunks)  # fmt: skip

    def _fits(self, waiting: Waiting, hit: Hit, deferred: bool) -> bool:
        books, timeline = self.books, self.timeline
        if books.outstanding + waiting.pages - hit.pages <= books.supply - hit.idle_pages:
            return True
        if not timeline.peak_active:
            return False
        return timeline.fits(timeline.shape_of(waiting, deferred), hit, books.supply)

    def _promise(self, head: str, deferred: bool) -> None:
        if not self.timeline.backfill:
            return
        made = backfill.promise(self.books, self.timeline, head, deferred)
        if made is not None:
            self._backfill, self.promised = made, (head, made.start)

    def _forget_promise(self) -> None:
        self._backfill, self.promised = None, None

    def _admit(self, rid: str, hit: Hit, deferred: bool) -> Admitted:
        books = self.books
        waiting = books.waiting.pop(rid)
        pages = waiting.pages
        books.running[rid] = Reservation(rid, pages, hit.pages, books.next_seq)
        books.outstanding += pages - hit.pages
        books.evictable -= hit.idle_pages  # the lease takes idle cached pages off the supply
        self.timeline.add(rid, waiting.shape, pages, hit, deferred=deferred)
        return self._decide(Admitted(rid, books.next_seq, pages, hit))

    def restore(self, rid: str, reserved: int, held: int) -> Reservation:
        """Re-register a request that was admitted before this ledger existed (a sidecar that
        restarted). It is not re-decided: the pages were promised already."""
        books = self.books
        books.check_new(rid)
        books.check_pages(reserved, "reserved")
        books.check_pages(held, "held")
        if held > reserved:
            raise InvalidPages(f"request {rid!r} holds {held} pages but reserved {reserved}")
        res = Reservation(rid, reserved, held, books.next_seq)
        books.running[rid] = res
        books.outstanding += reserved - held
        self.timeline.restore(rid, reserved, held)
        books.next_seq += 1
        self._after_change()
        return res

    def take(self, rid: str, pages: int) -> None:
        """A running request allocated `pages` new pages (from free, or by evicting idle ones)."""
        books = self.books
        res = books.reservation(rid)
        books.check_pages(pages, "pages")
        if res.held + pages > res.reserved:
            raise InvalidPages(
                f"request {rid!r} would hold {res.held + pages} pages but reserved "
                f"{res.reserved}; it may take at most {res.reserved - res.held} more"
            )
        res.held += pages
        books.outstanding -= pages
        books.take_supply(pages)
        self.timeline.take(rid, pages)
        self._after_change()

    def release(self, rid: str) -> Reservation:
        """A running request finished or was aborted: its unused promise is returned. The pages
        it held come back through `set_supply`, since only the pool knows which stay shared."""
        books = self.books
        res = books.reservation(rid)
        del books.running[rid]
        books.outstanding -= res.reserved - res.held
        self.timeline.remove(rid)
        self._after_change()
        return res

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        """A request of several sequences (OpenAI's `n`) gives back a finished sequence's share:
        `reserved` pages of its reservation, `held` of them held (freed; the next supply report
        counts them). `shape`: the growth of what still runs, for a ledger that follows
        progress. Raises InvalidPages, changing nothing, unless the numbers fit and the shape
        never rises; docs/admission.md ("Several sequences from one prompt") has why."""
        res = self.books.check_give_back(rid, held, reserved, shape)
        problem = self.timeline.check_give_back(rid, shape)
        if problem is not None:
            raise InvalidPages(problem)
        res.held -= held
        res.reserved -= reserved
        self.books.outstanding -= reserved - held
        self.timeline.give_back(rid, held, shape)
        self._after_change()

    def set_supply(self, free: int, evictable: int) -> None:
        """The pool's own count of free pages and of cached pages eviction can reach."""
        books = self.books
        books.check_pages(free, "free")
        books.check_pages(evictable, "evictable")
        if free + evictable > books.usable_pages:
            raise InvalidPages(
                f"free {free} + evictable {evictable} exceeds the pool's "
                f"{books.usable_pages} usable pages"
            )
        books.free, books.evictable = free, evictable
        self.timeline.supply_reported()
        self._after_change()

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a request admitted with `deferred`; `prefill_chunks` is its
        worst-case prefill steps from now. A request the ledger does not follow step by step
        (no policy, no shape, restored) needs no start: the call only checks that it runs."""
        self.books.reservation(rid)
        self.books.check_pages(prefill_chunks, "prefill_chunks", bounded=False)
        self.timeline.start(rid, prefill_chunks)
        self._after_change()

    def set_exclusive(self, rid: str, exclusive: int) -> None:
        """A running request's pages no one else holds, counted by the pool after a pin or a
        lease shared some of them (a progress report carries the same count each step)."""
        res = self.books.reservation(rid)
        self.books.check_pages(exclusive, "exclusive")
        if exclusive > res.held:
            raise InvalidPages(
                f"request {rid!r} reports {exclusive} exclusive pages of the {res.held} it holds"
            )
        self.timeline.set_exclusive(rid, exclusive)
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
        self.books.reservation(rid)
        timeline = self.timeline
        problem = timeline.check_advance(rid, produced, tokens_per_label, chunks_left, exclusive)
        if problem is not None:
            raise InvalidPages(problem)
        timeline.advance(rid, produced, tokens_per_label, chunks_left, exclusive)
        self._after_change()

    def end_step(self) -> list[str]:
        """Close a step; returns the running requests that did not advance in it (then the
        ledger admits conservatively until a step in which all of them advance)."""
        stalled = self.timeline.end_step()
        self._forget_promise()  # made for this step's admissions
        if self.debug:
            self.check_integrity()
        return stalled

    def _decide(self, decision: _D) -> _D:
        self.books.next_seq += 1
        self._after_change()
        return decision
