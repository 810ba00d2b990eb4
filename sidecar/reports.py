"""What one report does to a ledger: its events applied in order (`apply_events`), its tries
answered in order within the engine's room (`answer_tries`), and the pool figures a reply
carries (`fill_pool`). Pure functions over a `Ledger`: the caller (kvbank.sidecar.state) hands
them a copy, so a report that fails part way leaves the real ledger as it was."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvbank.fields import quote
from kvbank.ledger import Admitted, InvalidPages, Ledger, Refused
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.wire_forms import hit_from_wire, shape_from_wire

# Requests the ledger queues at most (`kvbank sidecar --max-waiting`). Every report copies the
# ledger (all-or-nothing), so an unbounded queue makes every report slower; an engine keeps its
# own queue far shorter (`kvbank serve --max-waiting`, 256 by default).
DEFAULT_MAX_WAITING = 8192


class QueueFull(Exception):
    """A submit past the sidecar's --max-waiting (RESOURCE_EXHAUSTED): nothing was queued."""


def apply_events(
    ledger: Ledger,
    req: pb.ReportRequest,
    unapplied: dict[int, int],
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> tuple[list[Admitted | Refused], list[str], list[str]]:
    """Apply a report's events and progress to `ledger`; returns the refusals at submit, the
    requests that arrived (queued) and the requests a closed step found stalled. `unapplied`
    maps admissions the engine has not applied yet to their idle hit pages: a supply report
    still counts those pages evictable, so they come off it (see kvbank.sidecar.state), and a
    release before the engine applied the admission drops its entry."""
    decisions: list[Admitted | Refused] = []
    arrived: list[str] = []
    stalled: list[str] = []
    for i, event in enumerate(req.events):
        with _at(f"events[{i}].{event.WhichOneof('kind')}"):
            _apply(ledger, event, unapplied, max_waiting, decisions, arrived, stalled)
    for i, step in enumerate(req.progress):
        with _at(f"progress[{i}]"):
            advance(ledger, step)
    return decisions, arrived, stalled


@contextmanager
def _at(where: str) -> Iterator[None]:
    """Name the event an error came from in the field it carries (`pages` becomes
    `events[3].take.pages`)."""
    try:
        yield
    except InvalidPages as exc:
        if exc.field:
            exc.field = f"{where}.{exc.field}"
        raise


def _apply(
    ledger: Ledger,
    event: pb.Event,
    unapplied: dict[int, int],
    max_waiting: int,
    decisions: list[Admitted | Refused],
    arrived: list[str],
    stalled: list[str],
) -> None:
    """One event: its decision (a refusal at submit), arrival or stalled requests are added to
    the lists."""
    kind = event.WhichOneof("kind")
    if kind == "submit":
        ev = event.submit
        if ledger.waiting_count() >= max_waiting:
            raise QueueFull(
                f"submit of {quote(ev.rid)}: the queue holds {ledger.waiting_count()} "
                f"requests, this sidecar's --max-waiting; the engine must hold requests "
                f"back (its --max-waiting below the sidecar's) or the sidecar queue more"
            )
        shape = shape_from_wire(ev.rid, ev.shape, ev.pages) if ev.HasField("shape") else None
        refused = ledger.submit(ev.rid, ev.pages, ev.refusal or None, shape=shape)
        if refused is not None:
            decisions.append(refused)
        else:
            arrived.append(ev.rid)
    elif kind == "cancel":
        ledger.cancel(event.cancel.rid)
    elif kind == "take":
        ledger.take(event.take.rid, event.take.pages)
    elif kind == "release":
        res = ledger.release(event.release.rid)
        unapplied.pop(res.seq, None)  # released before applied: its lease never comes
    elif kind == "supply":
        books = ledger.books
        books.check_pages(event.supply.free, "free", bounded=False)
        books.check_pages(event.supply.evictable, "evictable", bounded=False)
        # Idle pages of admissions the engine has not applied yet are still evictable in its
        # count (see kvbank.sidecar.state); they are leased already.
        evictable = max(0, event.supply.evictable - sum(unapplied.values()))
        check_supply(ledger, event.supply.free, evictable)
        # Unchanged figures are not a report, as with the embedded ledger: a peak
        # ledger counts released pages as returning until the next real report.
        if (event.supply.free, evictable) != (ledger.free, ledger.evictable):
            ledger.set_supply(event.supply.free, evictable)
    elif kind == "best_effort":  # not the ledger's: checked here, kept by the state
        ledger.books.check_pages(event.best_effort.held, "held")
        ledger.books.check_pages(event.best_effort.backlog, "backlog", bounded=False)
    elif kind == "advance":
        advance(ledger, event.advance)
    elif kind == "end_step":
        stalled.extend(ledger.end_step())
    elif kind == "start":
        ledger.start(event.start.rid, event.start.prefill_chunks)
    elif kind == "exclusive":
        ledger.set_exclusive(event.exclusive.rid, event.exclusive.pages)
    elif kind == "give_back":
        back = event.give_back
        shape = None
        if back.HasField("shape"):
            stays = ledger.reservation(back.rid).reserved - back.reserved
            shape = shape_from_wire(back.rid, back.shape, stays)
            shape.check(back.rid, stays, ledger.policy)
        ledger.give_back(back.rid, back.held, back.reserved, shape)
    else:
        raise InvalidPages(
            "an event must carry one of submit, cancel, take, release, supply, "
            "advance, end_step, start, exclusive, give_back, best_effort"
        )


def check_supply(ledger: Ledger, free: int, evictable: int) -> None:
    """Refuse a supply report that leaves no room for pages the ledger knows are held. A
    request's held pages are its own (its hit may be shared with others, so the sum over
    requests is not a bound, but any one request's pages are distinct): free and evictable pages
    plus the largest holding must fit the usable pages. Taken as is, such a report would let the
    ledger promise pages twice."""
    if free + evictable > ledger.usable_pages:
        return  # set_supply refuses it with its own message
    holder = max(ledger.running(), key=lambda r: r.held, default=None)
    if holder is not None and free + evictable + holder.held > ledger.usable_pages:
        room = ledger.usable_pages - free - evictable
        raise InvalidPages(
            f"supply free {free} + evictable {evictable} leaves {room} of the pool's "
            f"{ledger.usable_pages} usable pages held, but request {quote(holder.rid)} alone "
            f"holds {holder.held}; report the pool's figures after the takes and releases "
            f"before them"
        )


def advance(ledger: Ledger, step: pb.Progress) -> None:
    """One request's progress from the wire, checked for negative counts first, and its
    exclusive pages within what it holds (the timeline checks the rest only for requests it
    follows, but keeps the count of every request it holds: a restored one's too)."""
    exclusive = step.exclusive if step.HasField("exclusive") else None
    counts = {
        "produced": step.produced,
        "chunks_left": step.chunks_left,
        "exclusive": exclusive or 0,
        "tokens_per_label": min(step.tokens_per_label.values(), default=0),
    }
    negative = next((name for name, count in counts.items() if count < 0), None)
    if negative is not None:
        raise InvalidPages(
            f"progress of {quote(step.rid)}: produced {step.produced}, chunks_left "
            f"{step.chunks_left}, exclusive {exclusive} and tokens "
            f"{quote(dict(step.tokens_per_label))} must be >= 0",
            negative,
        )
    held = ledger.reservation(step.rid).held
    if exclusive is not None and exclusive > held:
        raise InvalidPages(
            f"progress of {quote(step.rid)} reports {exclusive} exclusive pages of the {held} "
            f"it holds; count only pages it holds and no other holder shares",
            "exclusive",
        )
    ledger.advance(
        step.rid, step.produced, dict(step.tokens_per_label) or None, step.chunks_left, exclusive
    )


def answer_tries(ledger: Ledger, req: pb.ReportRequest) -> tuple[list[Admitted], bool]:
    """Answer a report's tries in order (`Ledger.try_admit`), each against the ledger the ones
    before it left, admitting at most `room`; a try past the room is asked with no room (a head
    still gets its promise). A try for a request that is not waiting (refused at submit in this
    same report) is answered None. Returns the admissions and whether the head was refused for
    lack of pages. A report with `try_first` asks about that many waiting requests in FIFO
    order, each with its hit from `try_hits`; one with neither asks about every waiting request
    with no hit (a client that pins nothing)."""
    room = req.room if req.HasField("room") else None
    admitted: list[Admitted] = []
    head_waits = False
    questions: Sequence[pb.Try]
    if req.HasField("try_first"):
        hits = req.try_hits
        questions = [
            pb.Try(rid=rid, hit=hits[rid]) if rid in hits else pb.Try(rid=rid)
            for rid in ledger.waiting_rids(req.try_first)
        ]
    else:
        questions = req.tries or [pb.Try(rid=rid) for rid in ledger.waiting_rids()]
    for i, question in enumerate(questions):
        if not ledger.is_waiting(question.rid):
            continue
        with _at(f"tries[{i}]"):
            no_room = question.no_room or (room is not None and len(admitted) >= room)
            hit = None if no_room else hit_from_wire(question.rid, question.hit)
            chunks = question.prefill_chunks if question.HasField("prefill_chunks") else None
            is_head = question.rid == ledger.head
            decision = ledger.try_admit(question.rid, hit, chunks, deferred=not req.in_step)
        if decision is not None:
            admitted.append(decision)
        elif is_head and hit is not None:
            head_waits = True
    return admitted, head_waits


def fill_pool(pool: pb.PoolFigures, ledger: Ledger, totals: bool = True) -> None:
    """`totals` adds reserved and held, which cost a pass over the running requests: status
    has them, a report's reply (on every engine step) does not."""
    pool.total_pages = ledger.total_pages
    pool.usable_pages = ledger.usable_pages
    pool.free = ledger.free
    pool.evictable = ledger.evictable
    pool.outstanding = ledger.outstanding
    # A peak ledger's headroom costs a profile: sent when a waiting request may want a pin.
    if ledger.policy is None or not ledger.policy.peak or ledger.waiting_count():
        pool.headroom = max(0, ledger.headroom)
    if totals:
        running = ledger.running()
        pool.reserved = sum(r.reserved for r in running)
        pool.held = sum(r.held for r in running)
