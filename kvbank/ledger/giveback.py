"""Part of a reservation given back before the request ends: a request of several sequences
(OpenAI's `n`) whose sequence finished no longer needs that sequence's pages, held or still to
take, so its promise shrinks by them while the others run on."""

from __future__ import annotations

from kvbank.ledger.ledger import Ledger
from kvbank.ledger.shape import PeakShape
from kvbank.ledger.types import InvalidPages


def give_back(
    ledger: Ledger, rid: str, held: int, reserved: int, shape: PeakShape | None = None
) -> None:
    """`rid` gives back `reserved` pages of its reservation, `held` of them pages it held (now
    freed; the next supply report counts them). `shape`: the growth of what still runs (for a
    ledger that follows progress; kvbank.ledger.peak_shape with `live`), whose pages must be
    what stays reserved. Raises InvalidPages, changing nothing, unless 0 <= held <= reserved
    and what stays, held and reserved, stays a reservation."""
    books = ledger.books
    res = books.reservation(rid)
    books.check_pages(held, "held")
    books.check_pages(reserved, "reserved")
    if held > reserved or held > res.held or reserved - held > res.reserved - res.held:
        raise InvalidPages(
            f"request {rid!r} holds {res.held} of its {res.reserved} reserved pages; it cannot "
            f"give back {reserved} reserved pages of which {held} held (held <= reserved, and "
            f"at most what it holds and what it may still take)"
        )
    if shape is not None and shape.pages != res.reserved - reserved:
        raise InvalidPages(
            f"request {rid!r}: the shape of what still runs counts {shape.pages} worst-case "
            f"pages but {res.reserved - reserved} stay reserved; build both from the same count"
        )
    problem = ledger.timeline.check_give_back(rid, shape)
    if problem is not None:
        raise InvalidPages(problem)
    res.held -= held
    res.reserved -= reserved
    books.outstanding -= reserved - held
    ledger.timeline.give_back(rid, held, shape)
    ledger._after_change()
