"""How the engine talks to the banker's ledger: events in, ordered decisions out.

The engine never reads or changes a `Ledger` directly; it sends events to an `AdmissionBackend`
and applies the decisions the backend has ready. Two implementations sit behind the protocol: the
embedded one here, which wraps kvbank.ledger's `Ledger` in-process and decides synchronously, and a
gRPC one that forwards the same events to a sidecar and may answer a step later. The step loop
never blocks on either: `poll()` returns what is decided now, possibly nothing.

Events carry only numbers the engine computed itself: a request's page need comes from
`count_pages` (kvbank/capacity/count.py) over the server's own token counts, never from a client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Protocol

from kvbank.ledger import (
    NO_HIT,
    Admitted,
    Decision,
    Hit,
    InvariantBreach,
    Ledger,
    PeakPolicy,
    PeakShape,
    Refused,
    give_back,
)

# A peak-fit admission pass asks the engine for each candidate's hit in turn (None: that
# request cannot start now); the engine acts on each admission before the next question.
Peek = Callable[[str], Hit | None]


class AdmissionBackend(Protocol):
    def submit(self, rid: str, pages: int, refusal: str | None = None) -> None:
        """A request arrived; `pages` is its worst case from count_pages. FIFO from here."""
        ...

    def cancel(self, rid: str) -> None:
        """A waiting request left before it was admitted."""
        ...

    def report_hits(self, hits: Mapping[str, Hit]) -> None:
        """The cached hit of the waiting head, computed by peek. The engine has pinned these
        pages (see engine/admission/banker.py), so they hold until a decision is
        applied; a hit reported again for the same request only grows, and has no idle part
        (pinned pages are held)."""
        ...

    def take(self, rid: str, pages: int) -> None:
        """A running request allocated `pages` more pages. Raises when that exceeds its
        reservation: an engine bug, never to be absorbed."""
        ...

    def release(self, rid: str) -> None:
        """A running request finished or was aborted."""
        ...

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        """A running request gave back `reserved` pages of its reservation before its end, of
        which `held` it held and freed; `shape`: the growth of what still runs of it
        (kvbank.ledger.give_back)."""
        ...

    def set_supply(self, free: int, evictable: int) -> None:
        """The pool's free and evictable page counts after a change."""
        ...

    def poll(self, room: int) -> list[Decision]:
        """Decisions available now, in any order (the engine sorts them by sequence number).
        `room` is how many more requests the engine can start this step; a backend may use it
        to hold admissions back and must tolerate receiving no call for a while."""
        ...

    def collect(self) -> list[Decision]:
        """Decisions that already arrived, without asking for more (a remote backend reads the
        reply in flight if it is here). The engine applies them before it pins."""
        ...

    def settled(self) -> bool:
        """Whether every decision made so far is known to the engine. A pin may take only the
        slack the engine knows of, so it waits while a decision is on its way: that decision
        may have counted the pages the pin would take."""
        ...

    def outstanding(self) -> int:
        """Pages admitted requests may still take, as far as the backend knows."""
        ...

    def check_integrity(self, free: int, evictable: int) -> None:
        """Raise InvariantBreach unless the ledger is safe and agrees with the pool's supply."""
        ...


class PeakBackend(AdmissionBackend, Protocol):
    """What the peak-fit policies (engine/admission/peak.py) need beyond the banker's
    events: the ledger's mode, a step-by-step admission pass, and each running request's
    progress."""

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        """As AdmissionBackend.submit, with `shape` the request's growth per label
        (kvbank.ledger.peak_shape, from the engine's own count) for a peak-fit ledger."""
        ...

    def configure(self, policy: str, peak: PeakPolicy) -> None:
        """Run the ledger as `policy` (peak, peak+backfill, banker+backfill) with `peak`'s
        pace; before any request is submitted."""
        ...

    def set_prefill_chunks(self, rid: str, chunks: int) -> None:
        """A waiting request's worst-case prefill chunks if admitted now (they depend on the
        prefill queued ahead of it)."""
        ...

    def admissions(self, peek: Peek) -> Iterator[Admitted]:
        """Admit heads (and backfill) as `Ledger.admissions` does, asking `peek` for each
        candidate's hit and yielding each admission; the engine starts it before the next
        question. Only for a backend that does not defer."""
        ...

    @property
    def defers(self) -> bool:
        """True when decisions arrive a report later (a sidecar the engine does not wait on):
        the engine then pins the head's hit, reports it, and applies decisions from `poll`,
        reporting each `start`."""
        ...

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a deferred admission (`Ledger.start`)."""
        ...

    def set_exclusive(self, rid: str, pages: int) -> None:
        """A running request's exact exclusive pages after a pin shared some of them."""
        ...

    def headroom(self) -> int:
        """Pages a pin may take off the supply now with every promise kept (`Ledger.headroom`,
        as of the backend's latest knowledge, never more)."""
        ...

    def note_pin(self, cost: int) -> None:
        """A pin took `cost` pages of headroom; until the ledger has seen it, `headroom` is
        that much lower."""
        ...

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int],
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        """A running request's progress after a step (`Ledger.advance`)."""
        ...

    def end_step(self) -> list[str]:
        """Close the step; the running requests that made no progress in it, when known now."""
        ...

    def stalled_steps(self) -> int:
        """Steps in which a running request could not advance (the ledger fell back to the
        conservative reading), as far as the backend knows."""
        ...


class EmbeddedBackend:
    """The ledger in-process. Decides during `poll`, admitting at most `room` heads, each with
    the hit last reported for it (no hit when none was reported)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._hits: dict[str, Hit] = {}
        self._refused: list[Refused] = []
        # A busy step takes pages for many requests: go straight to the ledger, one frame less.
        self.take = ledger.take  # type: ignore[method-assign]

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        refused = self.ledger.submit(rid, pages, refusal, shape=shape)
        if refused is not None:
            self._refused.append(refused)

    def configure(self, policy: str, peak: PeakPolicy) -> None:
        ledger = self.ledger
        if ledger.policy == peak:
            return
        if ledger.waiting_count() or ledger.running():
            raise InvariantBreach(
                f"the ledger already holds requests; it cannot switch to the {policy} policy"
            )
        self.ledger = Ledger(ledger.total_pages, debug=ledger.debug, policy=peak)
        self.take = self.ledger.take  # type: ignore[method-assign]

    def set_prefill_chunks(self, rid: str, chunks: int) -> None:
        ledger = self.ledger
        shape = ledger.shape(rid)
        if shape is not None and shape.prefill_chunks != chunks:
            ledger.set_shape(rid, replace(shape, prefill_chunks=chunks))

    def admissions(self, peek: Peek) -> Iterator[Admitted]:
        if self._refused:  # the engine refuses a request the pool can never hold before this
            raise InvariantBreach(f"the ledger refused requests: {self._refused}")
        return self.ledger.admissions(peek)

    defers = False  # decides during the engine's own calls

    def start(self, rid: str, prefill_chunks: int) -> None:
        self.ledger.start(rid, prefill_chunks)

    def set_exclusive(self, rid: str, pages: int) -> None:
        self.ledger.set_exclusive(rid, pages)

    def headroom(self) -> int:
        return self.ledger.headroom

    def note_pin(self, cost: int) -> None:
        pass  # the pool's next supply report reaches the ledger before any decision

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int],
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        self.ledger.advance(rid, produced, tokens_per_label, chunks_left, exclusive)

    def end_step(self) -> list[str]:
        return self.ledger.end_step()

    def stalled_steps(self) -> int:
        return self.ledger.stalled_steps

    def cancel(self, rid: str) -> None:
        self._hits.pop(rid, None)
        self.ledger.cancel(rid)

    def report_hits(self, hits: Mapping[str, Hit]) -> None:
        self._hits.update(hits)

    def take(self, rid: str, pages: int) -> None:
        self.ledger.take(rid, pages)

    def release(self, rid: str) -> None:
        self.ledger.release(rid)

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        give_back(self.ledger, rid, held, reserved, shape)

    def set_supply(self, free: int, evictable: int) -> None:
        ledger = self.ledger
        if free != ledger.free or evictable != ledger.evictable:
            ledger.set_supply(free, evictable)

    def collect(self) -> list[Decision]:
        return []  # decides only when polled

    def take_refused(self) -> list[Refused]:
        """The refusals made at submit and not yet polled, handed over once."""
        refused, self._refused = self._refused, []
        return refused

    def settled(self) -> bool:
        return True

    def poll(self, room: int) -> list[Decision]:
        if not room and not self._refused:
            return []  # the busy step's path: nothing to decide
        decisions: list[Decision] = list(self._refused)
        self._refused.clear()
        ledger = self.ledger
        while room > 0 and (rid := ledger.head) is not None:
            hit = self._hits.get(rid, NO_HIT)
            if not ledger.can_admit_head(hit):
                break
            decisions.append(ledger.admit_head(hit))
            self._hits.pop(rid, None)
            room -= 1
        return decisions

    def outstanding(self) -> int:
        return self.ledger.outstanding

    def check_integrity(self, free: int, evictable: int) -> None:
        self.ledger.check_integrity()
        if (free, evictable) != (self.ledger.free, self.ledger.evictable):
            raise InvariantBreach(
                f"the pool's supply (free {free}, evictable {evictable}) differs from the "
                f"ledger's (free {self.ledger.free}, evictable {self.ledger.evictable})"
            )


def embedded(
    total_pages: int, debug: bool = False, policy: PeakPolicy | None = None
) -> EmbeddedBackend:
    return EmbeddedBackend(Ledger(total_pages, debug=debug, policy=policy))


__all__ = [
    "AdmissionBackend",
    "Admitted",
    "Decision",
    "EmbeddedBackend",
    "Hit",
    "PeakBackend",
    "Refused",
]
