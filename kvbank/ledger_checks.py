"""What the ledger checks: every argument before a change, and the safe-state invariant after
one (`check_integrity`; after every change in debug mode, which the tests run with).

An argument check raises before anything moved, so the ledger is unchanged when a LedgerError
comes out of it. The invariant check raises InvariantBreach with the numbers: a breach means the
ledger promised pages the pool cannot give, and which request holds the largest claim."""

from __future__ import annotations

from kvbank.ledger_state import LedgerState
from kvbank.ledger_types import DuplicateRequest, Hit, InvalidPages, InvariantBreach


class LedgerChecks(LedgerState):
    """The checks mixed into `Ledger`."""

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
