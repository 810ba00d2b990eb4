"""The admission-policy interface: what the scheduler asks, so one engine runs every policy.

The scheduler owns the queues and the step; a policy decides three things only: which waiting
requests start (`admit`, FIFO from the head), what happens when a running request cannot grow
(`on_shortage`: stall, or name a victim to preempt), and what it must be told as pages move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbank.engine.request import Request

if TYPE_CHECKING:
    from kvbank.engine.admission.backend import AdmissionBackend
    from kvbank.engine.scheduler import Scheduler


class AdmissionPolicy:
    name: str = ""
    sched: Scheduler

    def bind(self, sched: Scheduler) -> None:
        self.sched = sched

    def on_arrival(self, req: Request) -> None:
        """A request joined the tail of the waiting queue."""

    def on_cancel(self, req: Request) -> None:
        """A waiting request left (aborted) before it was admitted."""

    def admit(self) -> None:
        """Start waiting requests from the head, through `sched.start`, while the policy lets
        them in and `sched.can_start()` holds (token budget and running cap left)."""
        raise NotImplementedError

    def on_shortage(self, req: Request) -> Request | None:
        """`req` cannot get the pages for its next row. Return a running request to preempt
        (possibly `req` itself) and the scheduler retries; None: `req` sits this step out."""
        return None

    def on_take(self, req: Request, pages: int) -> None:
        """A running request allocated `pages` new pages."""

    def on_release(self, req: Request) -> None:
        """A running request left the running set: finished, aborted or preempted."""

    def end_step(self) -> None:
        """The step's pages have settled (after postprocess)."""

    def check_integrity(self) -> None:
        """Raise InvariantBreach when the policy's own books disagree with the pool."""

    def protected_pages(self) -> frozenset[int]:
        """Pages the waiting head will reuse: evicted only after every other idle page."""
        waiting = self.sched.waiting
        if not waiting:
            return frozenset()
        chains = self.sched.kv.peek(waiting[0])
        return frozenset(page for chain in chains.values() for page in chain)


PolicyFactory = Callable[["AdmissionBackend | None"], AdmissionPolicy]
POLICIES: dict[str, PolicyFactory] = {}


def register(name: str, factory: PolicyFactory) -> None:
    """Add a policy to the engine (and to `kvbank bench --policy all`, in registration order)."""
    POLICIES[name] = factory


def make_policy(name: str, backend: AdmissionBackend | None = None) -> AdmissionPolicy:
    _register_builtins()

    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
    return factory(backend)


def policy_names() -> list[str]:
    _register_builtins()

    return list(POLICIES)


def _register_builtins() -> None:
    """Importing the policy modules registers them (banker first, then the baselines)."""
    import kvbank.engine.admission.banker
    import kvbank.engine.admission.baselines
    import kvbank.engine.admission.peak  # noqa: F401
