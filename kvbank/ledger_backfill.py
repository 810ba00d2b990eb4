"""EASY backfill for the ledger (`PeakPolicy(backfill=True)`): when the head is blocked, find the
earliest step at which it surely fits, then let up to `backfill_depth` later requests start now,
each only if the head still fits at that step beside it. The head is never delayed, so nothing
starves; docs/admission.md gives the argument."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvbank.ledger_peak import PeakHooks, hold_of
from kvbank.ledger_types import Hit, InvalidPages


class Backfill(PeakHooks):
    """The backfill pass mixed into `Ledger`; `admit_ready` runs it behind a blocked head."""

    def _backfill(self, head: str, peek: Callable[[str], Hit | None]) -> Iterator[tuple[str, Hit]]:
        """The later requests that may start now, with their hits, one at a time: the caller
        admits each before the next is tried, so every test sees the ones admitted before it.
        Sets `promised` when the head gets a promise."""
        timeline, policy = self._timeline, self.policy
        assert timeline is not None and policy is not None
        if timeline.fallback or len(self._waiting) < 2:
            return
        head_shape = self._shape(self._waiting[head])
        start = timeline.promise(head, head_shape, self.supply)
        if start is None:
            return
        self.promised = (head, start)
        for rid in list(self._waiting)[1 : 1 + policy.backfill_depth]:
            waiting, hit = self._waiting[rid], peek(rid)
            if hit is None:
                break  # the caller cannot tell hits this far down the queue
            try:
                self._check_hit(hit, waiting.pages)
            except InvalidPages:
                continue  # a stale peek; the request waits for its turn
            hold = hold_of(hit)
            if timeline.fits_behind(head_shape, start, self._shape(waiting), hold, self.supply):
                yield rid, hit
