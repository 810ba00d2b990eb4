"""EASY backfill over the ledger's books and timeline (`PeakPolicy(backfill=True)`): when the
head is refused, find the earliest step at which it surely fits (the promise), then let up to
`backfill_depth` later requests start now, each only if the head still fits at that step beside
it (`Ledger.try_admit` asks `Timeline.fits_behind` for each). The head is never delayed, so
nothing starves; docs/admission.md gives the argument."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbank.ledger.books import Books
from kvbank.ledger.shape import PeakShape

if TYPE_CHECKING:
    from kvbank.ledger.ledger import AnyTimeline


@dataclass(frozen=True)
class Promise:
    """A refused head's promise: its shape, the steps from when it was made until it surely
    fits, and the requests that followed it then, the only ones tried behind it."""

    head: str
    shape: PeakShape
    start: int
    window: frozenset[str]


def promise(books: Books, timeline: AnyTimeline, head: str, deferred: bool) -> Promise | None:
    """The refused head's promise, or None when none can be made (the timeline fell back,
    nothing waits behind the head, or no step is in sight)."""
    if timeline.fallback or len(books.waiting) < 2:
        return None
    head_shape = timeline.shape_of(books.waiting[head], deferred)
    start = timeline.promise(head, head_shape, books.supply)
    if start is None:
        return None
    window = frozenset(itertools.islice(books.waiting, 1, 1 + timeline.backfill_depth))
    return Promise(head, head_shape, start, window)
