"""The admission-policy interface: what the scheduler asks, so one engine runs every policy.

The scheduler owns the queues, the cache and the step; a policy reads them through a read-only
`AdmissionView` (engine/admission/view.py) and returns decisions (engine/admission/actions.py)
the scheduler carries out. It decides three things only: which waiting requests start (`admit`,
FIFO from the head), what happens when a running request cannot grow (`on_shortage`: stall, or
preempt a victim), and what it must be told as pages move (the `on_*` events).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvbank.engine.admission.actions import Action, Preempt
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.request import Request


class AdmissionPolicy:
    name: str = ""
    # Whether eviction takes the waiting head's cached hit only after every other idle page
    # (a policy that pins the head's hit has no need).
    protects_head: bool = True
    # Whether a shortage preempts before it evicts the waiting head's cached hit (the grow is
    # tried sparing those pages first; `on_shortage(req, spared=True)` may then return None).
    spares_head: bool = False
    # Whether best-effort requests run as such (engine/admission/besteffort.py); a policy that
    # does not honour classes runs every request as strict.
    honours_classes: bool = False
    view: AdmissionView

    def bind(self, view: AdmissionView) -> None:
        self.view = view

    def on_arrival(self, req: Request) -> None:
        """A request joined the tail of the waiting queue."""

    def on_cancel(self, req: Request) -> None:
        """A waiting request left (aborted) before it was admitted; its pins are dropped."""

    def admit(self) -> Iterator[Action]:
        """Start waiting requests from the head while the policy lets them in and
        `view.can_start()` holds (token budget and running cap left), yielding each decision;
        the scheduler carries it out before the policy resumes."""
        raise NotImplementedError

    def head(self) -> Request | None:
        """The waiting request whose cached hit eviction takes last (the FIFO head)."""
        return self.view.waiting[0] if self.view.waiting else None

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        """`req` cannot get the pages for its next row (with `spared`, without the waiting
        head's cached pages). Return a running request to preempt (possibly `req` itself) and
        the scheduler retries; None: `req` sits this step out (with `spared`: the scheduler
        tries again, taking the head's pages)."""
        return None

    def on_requeue(self, req: Request) -> None:
        """A preempted request waits again (after its `on_release`)."""

    def on_take(self, req: Request, pages: int) -> None:
        """A running request allocated `pages` new pages."""

    def on_release(self, req: Request) -> None:
        """A running request left the running set: finished, aborted or preempted."""

    def on_give_back(self, req: Request, held: int, reserved: int) -> None:
        """A running request of several sequences no longer needs one of them: `reserved` pages
        of its worst case, `held` of which it held and freed."""

    def end_step(self) -> None:
        """The step's pages have settled (after postprocess)."""

    def check_integrity(self) -> None:
        """Raise InvariantBreach when the policy's own books disagree with the pool."""
