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
from kvbank.ledger.types import Hit

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


def refuses(
    books: Books,
    timeline: AnyTimeline,
    held: Promise | None,
    rid: str,
    most_held: int,
    prefill_chunks: int | None,
) -> bool:
    """Whether the waiting `rid` behind the head is refused now with any hit whose held part
    (pages less idle pages) is at most `most_held`: outside the promise's window, or over the
    supply at the running requests' peak step even with such a hit (`Timeline.over_at_peak`,
    the first test `fits_behind` makes). The caller then need not look its hit up. False for
    the head, and for a request that is not waiting (`try_admit` says what is wrong)."""
    if rid == books.head or rid not in books.waiting:
        return False
    waiting = books.waiting[rid]
    books.keep_chunks(waiting, prefill_chunks)  # as `try_admit` would, whatever it answers
    if held is None or rid not in held.window:
        return True
    shape = timeline.shape_of(waiting, False)
    return timeline.over_at_peak(shape, Hit(max(0, most_held)), books.supply)
