"""The one protocol between a host engine and the reservation ledger (`LedgerClient`): the
engine asks, the ledger answers.

The engine reports what its pool did (events: submit, take, release, supply, progress) and, for
each waiting request in its queue's order, asks `try_admit(rid, hit, prefill_chunks)`; an
`Admitted` is started before the next question, and None is an answer too: the request is asked
again at a later step. Two implementations: `EmbeddedClient` here, the ledger in-process, which
answers at once; and the sidecar's client (kvbank/sidecar/backend.py), which sends the same
events and tries over gRPC. A blocking sidecar client answers each try in its round trip. One
the step never waits on has `later` (`LateAnswers`): the engine pins the head's hit and reports
the pin (`pin`, engine/admission/decisions.py), the client sends it with the next report, and the
decisions come back through `collect` and `poll` a step or more later. Pins exist only where an
answer comes later: a client that answers in step has no `later`.

kvbank's own engine (engine/admission/) and the vLLM plug-in (kvbank/vllm/) import only this.
Events carry only numbers the engine computed itself: a request's page need comes from
`count_pages` (kvbank/capacity/count.py) over the server's own token counts, never from a client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvbank.ledger import (
    Admitted,
    Decision,
    Hit,
    InvariantBreach,
    Ledger,
    PeakPolicy,
    PeakShape,
    Refused,
)


@dataclass(frozen=True)
class StepEnd:
    """What closing a step tells the engine: the running requests that made no progress in it
    (when known now), and the steps so far in which a running request could not advance (the
    ledger fell back to the conservative reading), as far as the backend knows."""

    stalled: list[str]
    stalled_steps: int


@dataclass(frozen=True)
class BestEffortFigures:
    """The engine's best-effort requests, which are never the ledger's, as pickers route by
    them (the sidecar streams them): `held`, of the evictable pages, those only best-effort
    requests hold; `backlog`, the pages its queued best-effort requests need to start;
    `arrived`, the best-effort requests queued since the figures were last taken."""

    held: int
    backlog: int
    arrived: tuple[str, ...] = ()


class LateAnswers(Protocol):
    """What a client that answers later adds (a sidecar the step never waits on): its
    `try_admit` is never asked in step; the engine pins the head's hit and reports it (`pin`),
    reads the decisions as they arrive (`collect`, `poll`), and reports each `start`."""

    def collect(self) -> list[Decision]:
        """Decisions that already arrived, without asking for more (a remote client reads the
        reply in flight if it is here). The engine applies them before it pins."""
        ...

    def poll(self, room: int) -> list[Decision]:
        """Send what happened since the last report and return the decisions available now, in
        any order (the engine sorts them by sequence number). `room` is how many more requests
        the engine can start this step; a client may use it to hold admissions back and must
        tolerate receiving no call for a while."""
        ...

    def settled(self) -> bool:
        """Whether every decision made so far is known to the engine. A pin may take only the
        slack the engine knows of, so it waits while a decision is on its way: that decision
        may have counted the pages the pin would take."""
        ...

    def pin(self, rid: str, pages: int, cost: int, exclusive: Mapping[str, int]) -> None:
        """The engine pinned `pages` of the waiting head `rid`'s cached hit (engine/admission/
        decisions.py `HeadPin`), so they hold until a decision is applied: they are its hit,
        which for the same request only grows and has no idle part (pinned pages are held).
        The pin took `cost` pages of headroom (until the ledger has seen it, `headroom` is that
        much lower); `exclusive`: the running requests' exact exclusive pages, when the pin
        shared some of them."""
        ...

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started an admission decided a report ago (`Ledger.start`): until then
        the ledger keeps it open-ended (kvbank.ledger.open_ended)."""
        ...


class LedgerClient(Protocol):
    @property
    def later(self) -> LateAnswers | None:
        """None: every answer comes in step (`try_admit`). Else the client answers later, and
        the engine pins, reads its decisions and reports each start through this."""
        ...

    # ---- arrivals and admission ----------------------------------------------------------------

    def configure(self, policy: str, peak: PeakPolicy) -> None:
        """Run the ledger as `policy` (peak, peak+backfill, banker+backfill) with `peak`'s
        pace; before any request is submitted. Without a call: the banker."""
        ...

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        """A request arrived; `pages` is its worst case from count_pages, `shape` its growth
        per label (kvbank.ledger.peak_shape, from the engine's own count) for a peak-fit
        ledger. FIFO from here."""
        ...

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None:
        """May the waiting `rid` start now with `hit` (`Ledger.try_admit`)? None: not now; it
        is asked again at a later step. Not asked of a client with `later`."""
        ...

    def backfilling(self) -> bool:
        """Whether the head just refused has a promise, so the requests behind it are worth
        asking this step."""
        ...

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
        """Whether `try_admit` surely refuses `rid` behind the head with any hit whose held part
        is at most `most_held` (`Ledger.refuses_behind`), so its hit need not be looked up.
        False when the client cannot tell without asking (a sidecar's)."""
        ...

    def cancel(self, rid: str) -> None:
        """A waiting request left before it was admitted."""
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

    def set_supply(
        self, free: int, evictable: int, best_effort: BestEffortFigures | None = None
    ) -> None:
        """The pool's free and evictable page counts after a change; `best_effort`, its
        best-effort requests' figures, for a client that serves pickers (others ignore them)."""
        ...

    def outstanding(self) -> int:
        """Pages admitted requests may still take, as far as the backend knows."""
        ...

    def check_integrity(self, free: int, evictable: int) -> None:
        """Raise InvariantBreach unless the ledger is safe and agrees with the pool's supply."""
        ...

    def headroom(self) -> int:
        """Pages a pin may take off the supply now with every promise kept (`Ledger.headroom`,
        as of the backend's latest knowledge, never more)."""
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

    def end_step(self) -> StepEnd:
        """Close the step: the running requests that made no progress in it, when known now, and
        the stalled steps so far (`StepEnd`)."""
        ...


T = TypeVar("T")


class Answers(Protocol):
    """What an admission pass asks: a `LedgerClient`, or a `Ledger` itself."""

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None: ...

    def backfilling(self) -> bool: ...

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool: ...


def ask_in_order(
    client: Answers,
    queue: Callable[[], Sequence[T]],
    rid: Callable[[T], str],
    ask: Callable[[T], tuple[Hit | None, int | None]],
    depth: int,
    bound: Callable[[T], tuple[int, int | None]] | None = None,
) -> Iterator[tuple[T, Admitted]]:
    """One admission pass, for every host: ask the ledger about the head of the waiting queue
    (`queue()`, read afresh: the ledger's own order) while it is admitted, then, behind a
    refused head whose promise holds (`backfilling`), about the next `depth` as they stood
    then. `ask(item)` gives its hit (None: it cannot start this step, which ends the pass
    behind the head) and its prefill bound. Each admission is yielded before the next
    question: the host starts it first (taking it off its queue), so the next question sees
    its lease and its pages, and a request queued meanwhile (a best-effort one promoted by a
    preemption that made room) is asked in the same pass. `bound(item)`: the most its hit's
    held part can be, and its prefill bound, cheaper than `ask`: behind the head, a request the
    ledger refuses whatever such hit it brings (`refuses_behind`) is passed over unasked, which
    changes no answer (the look-up `ask` makes is most of a refused request's cost)."""
    while waiting := queue():
        item = waiting[0]
        hit, chunks = ask(item)
        decision = client.try_admit(rid(item), hit, chunks)
        if decision is None:
            break
        yield item, decision
    else:
        return
    if not client.backfilling():
        return
    for item in list(waiting)[1 : 1 + depth]:
        if bound is not None and client.refuses_behind(rid(item), *bound(item)):
            continue
        hit, chunks = ask(item)
        decision = client.try_admit(rid(item), hit, chunks)
        if decision is not None:
            yield item, decision
        elif hit is None:
            return


class EmbeddedClient:
    """The ledger in-process: `try_admit` answers at once, so nothing comes later."""

    later: LateAnswers | None = None

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
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

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None:
        if self._refused:  # the engine refuses a request the pool can never hold before this
            raise InvariantBreach(f"the ledger refused requests: {self._refused}")
        return self.ledger.try_admit(rid, hit, prefill_chunks)

    def backfilling(self) -> bool:
        return self.ledger.backfilling()

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
        return self.ledger.refuses_behind(rid, most_held, prefill_chunks)

    def headroom(self) -> int:
        return self.ledger.headroom

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int],
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        self.ledger.advance(rid, produced, tokens_per_label, chunks_left, exclusive)

    def end_step(self) -> StepEnd:
        ledger = self.ledger
        stalled = ledger.end_step()
        return StepEnd(stalled, ledger.stalled_steps)

    def cancel(self, rid: str) -> None:
        self.ledger.cancel(rid)

    def take(self, rid: str, pages: int) -> None:
        self.ledger.take(rid, pages)

    def release(self, rid: str) -> None:
        self.ledger.release(rid)

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        self.ledger.give_back(rid, held, reserved, shape)

    def set_supply(
        self, free: int, evictable: int, best_effort: BestEffortFigures | None = None
    ) -> None:
        ledger = self.ledger
        if free != ledger.free or evictable != ledger.evictable:
            ledger.set_supply(free, evictable)

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
) -> EmbeddedClient:
    return EmbeddedClient(Ledger(total_pages, debug=debug, policy=policy))


__all__ = [
    "BestEffortFigures",
    "EmbeddedClient",
    "LateAnswers",
    "LedgerClient",
    "StepEnd",
    "ask_in_order",
    "embedded",
]
