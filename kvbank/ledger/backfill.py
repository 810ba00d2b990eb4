"""EASY backfill over the ledger's books and timeline (`PeakPolicy(backfill=True)`): when the
head is blocked, find the earliest step at which it surely fits, then let up to `backfill_depth`
later requests start now, each only if the head still fits at that step beside it. The head is
never delayed, so nothing starves; docs/admission.md gives the argument."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvbank.ledger.books import Books
from kvbank.ledger.shape import PeakShape
from kvbank.ledger.types import Hit, InvalidPages

if TYPE_CHECKING:
    from kvbank.ledger.ledger import AnyTimeline


def promise(
    books: Books, timeline: AnyTimeline, head: str, deferred: bool
) -> tuple[PeakShape, int] | None:
    """The blocked head's shape and the steps from now until it surely fits, or None when no
    promise can be made (the timeline fell back, nothing waits behind the head, or no step is
    in sight)."""
    if timeline.fallback or len(books.waiting) < 2:
        return None
    head_shape = timeline.shape_of(books.waiting[head], deferred)
    start = timeline.promise(head, head_shape, books.supply)
    return None if start is None else (head_shape, start)


def behind(
    books: Books,
    timeline: AnyTimeline,
    head: PeakShape,
    start: int,
    peek: Callable[[str], Hit | None],
    depth: int,
    deferred: bool,
) -> Iterator[tuple[str, Hit]]:
    """The later requests that may start now without delaying the head promised `start`, with
    their hits, one at a time: the caller admits each before the next is tried, so every test
    sees the ones admitted before it."""
    for rid in list(books.waiting)[1 : 1 + depth]:
        waiting, hit = books.waiting[rid], peek(rid)
        if hit is None:
            break  # the caller cannot tell hits this far down the queue
        try:
            books.check_hit(hit, waiting.pages)
        except InvalidPages:
            continue  # a stale peek; the request waits for its turn
        shape = timeline.shape_of(waiting, deferred)
        if timeline.fits_behind(head, start, shape, hit, books.supply):
            yield rid, hit
