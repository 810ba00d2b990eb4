"""The ledger policy's parts for a backend that decides later (`LedgerParts`): reading its
decisions in the engine, once each, in sequence order; and pinning the waiting head's hit.

The ledger policy (engine/admission/ledger_policy.py), over a client that answers later
(`LedgerClient.later`), reads decisions that may arrive late, twice, or for a request that left
meanwhile. Here: a
decision at or below the last applied sequence number is skipped (a backend that resends is
harmless); an admission of a request that is gone is released at once; a refusal becomes a
`Reject`; an admission must reserve what the engine counts and lease no more than is pinned for
it, and it leases the pins up to its hit (the scheduler drops the rest). Starting the request is
the caller's, one admission at a time, in order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from kvbank.engine.admission.actions import Action, Pin, Preempt, Reject
from kvbank.engine.admission.besteffort import BestEffort
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request
from kvbank.ledger import Admitted, Decision, InvariantBreach, UnknownRequest
from kvbank.ledger.client import LateAnswers, LedgerClient


@dataclass(frozen=True)
class Admission:
    """An admission to start: its request, the ledger's decision and the pins it leases."""

    req: Request
    decision: Admitted
    lease: Chains


class DecisionReader:
    def __init__(self) -> None:
        self.last_seq = -1

    def admissions(
        self,
        view: AdmissionView,
        backend: LedgerClient,
        decisions: list[Decision],
        forget: Callable[[str], None],
    ) -> Iterator[Admission | Reject]:
        """The admissions to start, each with its waiting request and the pins it leases, and
        the refusals; `forget(rid)` runs for every decided request still waiting."""
        for decision in sorted(decisions, key=lambda d: d.seq):
            if decision.seq <= self.last_seq:
                continue  # a resent decision: applied once
            self.last_seq = decision.seq
            req = view.waiting_by_rid.get(decision.rid)
            if req is None:  # it left while the decision was on its way
                if isinstance(decision, Admitted):
                    backend.release(decision.rid)
                continue
            forget(req.rid)
            if not isinstance(decision, Admitted):
                yield Reject(req)
                continue
            if decision.reserved != req.count.total:
                raise InvariantBreach(
                    f"request {req.rid!r} was admitted for {decision.reserved} pages but the "
                    f"engine counts {req.count.total}"
                )
            pinned = view.kv.pinned_pages(req)
            if decision.hit.pages > pinned:
                raise InvariantBreach(
                    f"request {req.rid!r} was admitted with a {decision.hit.pages}-page hit but "
                    f"only {pinned} pages are pinned for it"
                )
            keep = decision.hit.pages // max(1, len(req.layout))
            lease = {name: chain[:keep] for name, chain in req.pinned.items()} if keep else {}
            yield Admission(req, decision, lease)


class HeadPin:
    """The waiting head's cached hit, pinned for a backend that decides later and reported to it.

    Why pin rather than only protect: the decision comes a step later, and a page reported as a
    hit must still be there when the `Admitted` is applied, or the request would need more pages
    than it reserved. A pinned page is held, so it leaves the evictable supply at once (the pool
    reports the lower supply) and the hit is reported with no idle part. That changes no
    decision for the head: leasing an idle page saves it one page of need and costs the supply
    one page. To keep the ledger safe while a pin waits, pages are pinned only within the
    ledger's headroom.

    Only the head is pinned. A pin behind the head would not be neutral: a page a running
    request holds today would stay held by the pin after that request finishes, never returning
    to the supply the head is waiting for, and a head that needs the whole pool would wait
    forever (the property test found exactly that).

    A pin only grows while its
    request waits, within the ledger's headroom; with the head, the index and the headroom
    as they were at the last pin, it cannot grow, so the busy step costs one comparison, not a
    peek."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}  # rid -> pinned pages last reported
        self._at: tuple[str, int, int] | None = None  # (head, index version, headroom) after it

    def forget(self, rid: str) -> None:
        self._reported.pop(rid, None)

    def grow(
        self,
        view: AdmissionView,
        backend: LedgerClient,
        later: LateAnswers,
        best_effort: BestEffort,
        sole_costs: bool = False,
    ) -> Generator[Action, None, None]:
        """Pin more of the head's hit (a `Pin` the scheduler carries out) and, when the pin
        changed, report the pool's supply and the pin: pinned pages are held, so the hit has no
        idle part, and no running request counts one as its own any more, so no sole part.
        The budget is the ledger's `headroom`.
        Under `sole_costs` (peak-fit) the report also says what the pin cost (idle pages left
        the supply, and a page one running request held alone no longer returns when that
        request finishes, now shared with the pin) and, when it shared pages, every running
        strict request's exact exclusive count."""
        head = best_effort.head()
        if head is None or not head.cacheable:
            return
        kv = view.kv
        allowed = backend.headroom()
        if (head.rid, kv.index_version, allowed) == self._at:
            return
        depth = len(next(iter(head.pinned.values()), ()))
        yield Pin(head, allowed, sole_costs)
        pinned = kv.pinned_pages(head)
        self._at = (head.rid, kv.index_version, backend.headroom())
        if pinned == self._reported.get(head.rid, 0):
            return
        self._reported[head.rid] = pinned
        backend.set_supply(*kv.ledger_supply())
        cost, shared = 0, False
        if sole_costs:
            cost, shared = kv.pin_cost(p for chain in head.pinned.values() for p in chain[depth:])
        running = best_effort.strict_running() if shared else ()
        later.pin(head.rid, pinned, cost, {req.rid: kv.exclusive_pages(req) for req in running})


class LedgerParts:
    """What the ledger policy (engine/admission/ledger_policy.py) holds for its decisions: the
    decision reader, the head's pin, and what it does as a request leaves the queue, cannot
    grow, or the pool is checked."""

    def __init__(self) -> None:
        self.reader = DecisionReader()
        self.pin = HeadPin()

    def cancel(self, backend: LedgerClient, best_effort: BestEffort, req: Request) -> None:
        """A waiting request left: a best-effort one only the engine's queue knew of."""
        best_effort.leave_queue(req)
        if req.best_effort:
            return
        self.pin.forget(req.rid)
        # A remote ledger may have admitted it already: the reader releases that admission.
        with contextlib.suppress(UnknownRequest):
            backend.cancel(req.rid)

    @staticmethod
    def shortage(
        name: str,
        view: AdmissionView,
        backend: LedgerClient,
        best_effort: BestEffort,
        req: Request,
        spared: bool,
    ) -> Preempt | None:
        """A request cannot grow: a best-effort victim makes room (None once the head's cached
        pages were `spared`: the scheduler then retries without sparing them). With no victim
        left, a request that cannot grow is a broken promise: a ledger policy preempts no
        strict request."""
        victim = best_effort.shortage(req)
        if victim is not None or spared:
            return victim
        raise InvariantBreach(
            f"request {req.rid!r} could not grow under {name}: it holds {req.held} of its "
            f"{req.count.total} reserved pages, supply is {view.kv.supply}, ledger "
            f"outstanding {backend.outstanding()}"
        )

    @staticmethod
    def check(view: AdmissionView, backend: LedgerClient) -> None:
        backend.check_integrity(*view.kv.ledger_supply())
