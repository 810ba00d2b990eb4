"""The banker policy: admission through the ledger (`LedgerClient`), never a preemption.

Each step, before asking for decisions, the engine pins the cached hit of the first waiting
requests and reports it. Why pin rather than only protect: a remote backend may decide a step
later, and a page reported as a hit must still be there when the `Admitted` is applied, or the
request would need more pages than it reserved. A pinned page is held, so it leaves the evictable
supply at once (the pool reports the lower supply) and the hit is reported with no idle part.
That changes no decision for the head: leasing an idle page saves it one page of need and costs
the supply one page, so `outstanding + need <= supply` reads the same either way. To keep the
ledger safe while a pin waits, idle pages are pinned only up to the slack (`supply - outstanding`).

Only the head is pinned. A pin behind the head would not be neutral: a page a running request
holds today would stay held by the pin after that request finishes, never returning to the
supply the head is waiting for, and a head that needs the whole pool would wait forever (the
property test found exactly that). With the embedded backend the loop below re-pins each new head
before asking again, so every admission still leases its cached prefix.

Decisions are applied in sequence order and at most once: a sequence number at or below the last
applied one is skipped, so a backend that resends is harmless.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

from kvbank.engine.admission.actions import Action, Preempt, Reject, Start
from kvbank.engine.admission.besteffort import BestEffort
from kvbank.engine.admission.decisions import LedgerParts
from kvbank.engine.admission.policy import AdmissionPolicy
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.request import Request
from kvbank.ledger import Decision
from kvbank.ledger.client import LedgerClient
from kvbank.service_class import ClassPolicy


class BankerPolicy(AdmissionPolicy):
    name = "banker"
    protects_head = False  # the head's hit is pinned, not merely protected
    honours_classes = True  # best-effort requests beside strict ones (besteffort.py)
    spares_head = True

    def __init__(self, backend: LedgerClient, classes: ClassPolicy | None = None) -> None:
        self.classes = classes or ClassPolicy()
        self._parts = LedgerParts()
        self._reader, self._pin = self._parts.reader, self._parts.pin
        self.backend = backend
        self._take = backend.take  # bound once: a busy step takes pages for many requests

    def bind(self, view: AdmissionView) -> None:
        super().bind(view)
        self.best_effort = BestEffort(self.classes, view, view.max_running)

    def on_arrival(self, req: Request) -> None:
        if self.best_effort.arrive(req):
            return  # best-effort: never in the ledger's books
        # The page need is the engine's own count_pages result, never a client's number.
        self.backend.submit(req.rid, req.count.total)

    def on_requeue(self, req: Request) -> None:
        if self.best_effort.requeue(req):
            self.backend.submit(req.rid, req.count.total)  # promoted: strict from now on

    def head(self) -> Request | None:
        return self.best_effort.head()

    def admit(self) -> Iterator[Action]:
        view, backend = self.view, self.backend
        yield from self._apply(backend.collect())
        while True:
            if backend.settled():
                # Idle pages only up to the slack, so the ledger stays safe while the pin waits.
                yield from self._pin.grow(view, backend, self._slack, self.head())
            room = 1 if view.can_start() else 0
            decisions = self.backend.poll(room)
            admitted = yield from self._apply(decisions)
            if not admitted or not room:
                break
        yield from self.best_effort.admit()

    def _slack(self) -> int:
        return max(0, self.view.kv.supply - self.backend.outstanding())

    def _apply(self, decisions: list[Decision]) -> Generator[Action, None, bool]:
        """Apply decisions in sequence order; returns whether any request was admitted."""
        admitted = False
        for item in self._reader.admissions(self.view, self.backend, decisions, self._pin.forget):
            self.best_effort.leave_queue(item.req)
            if isinstance(item, Reject):
                yield item
                continue
            yield from self.best_effort.make_room(item.req, item.lease)
            yield Start(item.req, item.lease)
            admitted = True
        return admitted

    def on_take(self, req: Request, pages: int) -> None:
        if req.rid not in self.best_effort.running:
            self._take(req.rid, pages)  # raises if past the reservation: a bug, never absorbed

    def on_release(self, req: Request) -> None:
        if not self.best_effort.released(req):
            self.backend.release(req.rid)

    def on_give_back(self, req: Request, held: int, reserved: int) -> None:
        self.backend.give_back(req.rid, held, reserved)

    def end_step(self) -> None:
        self.backend.set_supply(*self.view.kv.ledger_supply())  # reclaimable pages included
        self.best_effort.end_step()

    def on_cancel(self, req: Request) -> None:
        self._parts.cancel(self.backend, self.best_effort, req)

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        return self._parts.shortage(
            self.name, self.view, self.backend, self.best_effort, req, spared
        )

    def check_integrity(self) -> None:
        self._parts.check(self.view, self.backend)
