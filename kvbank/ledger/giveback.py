"""Part of a reservation given back before the request ends: a request of several sequences
(OpenAI's `n`) whose sequence finished no longer needs that sequence's pages, held or still to
take, so its promise shrinks by them while the others run on. A ledger that follows progress
(kvbank/ledger/timeline.py) also has the request follow the growth of what still runs of it;
docs/admission.md ("Several sequences from one prompt") has why no promise breaks."""

from __future__ import annotations

from kvbank.ledger.ledger import Ledger
from kvbank.ledger.shape import NEVER, PeakShape
from kvbank.ledger.timeline import Timeline
from kvbank.ledger.types import InvalidPages


def give_back(
    ledger: Ledger, rid: str, held: int, reserved: int, shape: PeakShape | None = None
) -> None:
    """`rid` gives back `reserved` pages of its reservation, `held` of them pages it held (now
    freed; the next supply report counts them). `shape`: the growth of what still runs (for a
    ledger that follows progress; kvbank.ledger.peak_shape with `live`), whose pages must be
    what stays reserved. Raises InvalidPages, changing nothing, unless 0 <= held <= reserved,
    what stays, held and reserved, stays a reservation, and the shape never rises."""
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
    timeline = ledger.timeline
    if isinstance(timeline, Timeline):
        problem = _check(timeline, rid, shape)
        if problem is not None:
            raise InvalidPages(problem)
    res.held -= held
    res.reserved -= reserved
    books.outstanding -= reserved - held
    if isinstance(timeline, Timeline):
        _follow(timeline, rid, held, shape)
    ledger._after_change()


def _check(timeline: Timeline, rid: str, shape: PeakShape | None) -> str | None:
    """What is wrong with the curve the request would follow, or None: it must be of the same
    labels and never above the one it follows now."""
    track = timeline.tracks[rid]
    if shape is None or track.budget == NEVER:
        return None
    if shape.labels != track.labels:
        return f"request {rid!r} gives back labels {shape.labels}; it writes {track.labels}"
    checks = [("worst", shape.worst, track.worst)]
    if timeline.peak_policy.peak:  # a flat curve (the conservative reading) has no rate
        checks.append(("per_output", shape.per_output, track.per_output))
    for name, new, old in checks:
        if any(a > b for a, b in zip(new, old, strict=True)):
            return f"request {rid!r} gives back pages but its {name} {new} rose from {old}"
    return None


def _follow(timeline: Timeline, rid: str, held: int, shape: PeakShape | None) -> None:
    """The freed pages are no longer the request's to hold or return; from its progress so far
    it follows `shape`, by at most the freed pages less at every step (kvbank.capacity's
    group_tokens), so its demand does not rise while the supply does."""
    track = timeline.tracks[rid]
    track.held -= held
    track.exclusive = max(0, track.exclusive - held)
    if shape is not None and track.budget != NEVER:
        track.worst, track.base = shape.worst, shape.base
        if timeline.peak_policy.peak:
            track.per_output = shape.per_output
            track.tokens = [min(t, w) for t, w in zip(track.tokens, shape.worst, strict=True)]
        else:
            track.tokens = list(shape.worst)
    timeline._changed()  # the profile is stale
