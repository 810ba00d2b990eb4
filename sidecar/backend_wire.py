"""The two parts of `SidecarBackend` (sidecar/backend.py) besides its engine-facing API: its books
(`BackendBooks`: the registry of running requests, the events queued and the decisions ready) and
its wire (`ReportWire`: it builds each report from the queued events, sends it, waiting or
leaving it in flight, absorbs the reply into the books, and (re)opens the session). One report is
in flight at a time, so every reply is read before the next report is built.

The sidecar restarts (SIGKILL) or drops the session: the call fails with ABORTED, and the backend
opens a new session that re-registers every running request with what it reserved and holds
(`Ledger.restore`), then resubmits the waiting ones in FIFO order. Pending events are dropped, not
resent: the registry already counts every take and release, so nothing is lost or counted twice.
A serving (non-blocking) backend whose call goes unanswered past its budget does the same once a
sidecar answers again, trying with bounded backoff; until then its `outage` says why, and the
engine admits nothing (see `ReportWire`). The events queued while a session opens are kept: the
opening request's registry counts everything before it, they count what came after.

The registry of running requests (reserved, held) is what a restore needs; it also answers
`outstanding()` between reports. Admission itself is decided only by the sidecar's ledger.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvbank.ledger import (
    Admitted,
    Decision,
    Hit,
    Refused,
)
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SessionLost, SidecarClient, SidecarError, SidecarUnavailable
from kvbank.sidecar.wire_forms import Report, as_ledger_error, submit_to_wire

log = logging.getLogger("kvbank.sidecar")
# `ReportWire.idle`'s answers: call again soon (a call is in flight), or when quiet.
IDLE_BUSY_S, IDLE_QUIET_S = 0.02, 0.5
# An engine draining its events toward a session being re-opened turns at this pace.
DRAIN_PAUSE_S = 0.05
# What kvbank's own engine does while its sidecar is away (the outage's log line says it).
ENGINE_OUTAGE_EFFECT = "new requests get 503 and /health fails until it answers"


@dataclass
class BackendBooks:
    """What `SidecarBackend` keeps between reports: the requests it knows of, the events and hits
    queued for the next report, and the decisions ready for the engine."""

    # rid -> pages, refusal, shape (for a peak-fit ledger)
    waiting: OrderedDict[str, tuple[int, str, pb.PeakShape | None]] = field(
        default_factory=OrderedDict
    )
    policy: str = "banker"
    pace: pb.LedgerPace | None = None
    stalled: list[str] = field(default_factory=list)
    stalled_steps: int = 0
    running: dict[str, list[int]] = field(default_factory=dict)  # rid -> [reserved, held]
    outstanding: int = 0
    hits: dict[str, Hit] = field(default_factory=dict)
    events: list[pb.Event] = field(default_factory=list)
    supply: tuple[int, int] | None = None  # the pool's last (free, evictable)
    # Whether the sidecar's ledger holds exactly `supply`: a take or an admission's lease moves
    # the ledger's own figures, and then the next report must be sent even if the pool reports
    # the same numbers again.
    supply_in_ledger: bool = False
    best_effort: tuple[int, int] = (0, 0)  # the best-effort (held, backlog) last sent
    ready: list[Decision] = field(default_factory=list)
    applied_seq: int = -1  # last decision handed to the engine
    last_seq: int = -1  # last decision seen
    last_pool: pb.PoolFigures | None = None
    # Pages pins took off the headroom since the report the last reply answered: in the report
    # in flight, and not yet reported (see SidecarBackend.headroom).
    pin_cost_inflight: int = 0
    pin_cost_pending: int = 0

    def absorb(self, reply: pb.ReportReply) -> None:
        """A reply's figures and decisions."""
        self.last_pool = reply.pool
        self.pin_cost_inflight = 0  # the reply's headroom counts every pin reported so far
        self.stalled += reply.stalled
        self.stalled_steps = max(self.stalled_steps, reply.stalled_steps)
        cancelled = []
        for d in reply.decisions:
            self.last_seq = max(self.last_seq, d.seq)
            kind = d.WhichOneof("outcome")
            if kind == "restored":
                continue  # the engine runs it already
            if self.waiting.pop(d.rid, None) is None:
                cancelled.append(d.rid)  # cancelled while this report was in flight
            self.hits.pop(d.rid, None)
            if kind == "admit":
                wire = d.admit.hit
                sole = wire.sole_pages if wire.HasField("sole_pages") else None
                hit = Hit(wire.pages, wire.idle_pages, sole)
                self.running[d.rid] = [d.admit.reserved, hit.pages]
                if hit.idle_pages:
                    self.supply_in_ledger = False
                self.outstanding += d.admit.reserved - hit.pages
                self.ready.append(Admitted(d.rid, d.seq, d.admit.reserved, hit))
            else:
                self.ready.append(Refused(d.rid, d.seq, d.refuse.message))
        if cancelled:
            self.events = [
                e for e in self.events if not (e.HasField("cancel") and e.cancel.rid in cancelled)
            ]


@dataclass(frozen=True)
class Outage:
    """Why the serving engine cannot reach its sidecar now: the address, the gRPC status of the
    last failed call and since when (monotonic). While one lasts the engine admits nothing."""

    address: str
    code: str
    message: str
    since: float

    def describe(self) -> str:
        return (
            f"the admission sidecar at {self.address} does not answer ({self.code}: "
            f"{self.message[:200]})"
        )


class ReportWire:
    """The session with the sidecar and the one report in flight, over `books`.

    Non-blocking (serving), the wire never waits and never raises for a sidecar it cannot
    reach: a session is opened on the sender thread like a report, and a call that fails
    UNAVAILABLE (after the client's retry budget) ends the session and starts an `outage`,
    logged once; a new session is tried with bounded backoff until one opens, re-registering
    what runs then."""

    RETRY_FIRST_S = 0.1
    RETRY_MAX_S = 2.0  # a restarted sidecar is found within this, plus the client's budget

    def __init__(
        self,
        client: SidecarClient,
        books: BackendBooks,
        total_pages: int,
        engine_id: str = "engine",
        lease_s: float = 10.0,
        unanswered_s: float | None = None,
        outage_effect: str = ENGINE_OUTAGE_EFFECT,
    ) -> None:
        self.client = client
        self.outage_effect = outage_effect  # what the host does while admission is lost
        # Non-blocking: how long a call may go unanswered before the outage starts (the retry
        # budget of its calls; None: the client's own).
        self.unanswered_s = unanswered_s
        self.books = books
        self.total_pages = total_pages
        self.engine_id = engine_id
        self.lease_ms = int(lease_s * 1000)
        self.sessions_opened = 0
        self.session = 0
        self.report_seq = 0
        self.inflight: Future[pb.ReportReply] | None = None
        self.opening: Future[pb.OpenSessionReply] | None = None
        self.outage: Outage | None = None
        self.next_open_at = 0.0
        self.retry_s = self.RETRY_FIRST_S
        self.last_report_at = 0.0

    def build(self, room: int, admit: bool, tries: list[pb.Try] | None = None) -> Report:
        """The next report: the queued events and, to `admit`, the questions (`tries` given: an
        engine asking in step, which waits for the answer and starts each admission first;
        else the first waiting requests in FIFO order, as many as `room` admissions and a
        backfill window behind a refused head can use, each with the hit its engine pinned).
        Plain values: the message is made where it is sent (`Report.to_wire`)."""
        if not self.session:
            self.open()
        books = self.books
        self.report_seq += 1
        books.pin_cost_inflight += books.pin_cost_pending
        books.pin_cost_pending = 0
        self.last_report_at = time.monotonic()
        try_first = 0
        if tries is None and admit:
            # The sidecar's queue is this engine's FIFO: name how many, not each of them.
            try_first = room + (1 + books.pace.backfill_depth if books.pace is not None else 0)
        events, books.events = books.events, []
        hits = dict(books.hits) if try_first else None
        return Report(self.session, self.report_seq, books.applied_seq, events, admit, room,
                      tries, try_first, hits)  # fmt: skip

    def send(self, report: Report) -> pb.ReportReply:
        try:
            return self.client.report(report.to_wire())
        except SessionLost:
            self.open()
            return self.send(self.build(report.room, report.admit, report.tries))
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc

    def exchange(self, room: int, admit: bool) -> None:
        """Build a report, send it, wait for the reply and absorb it."""
        self.books.absorb(self.send(self.build(room, admit)))

    # ---- non-blocking ----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """A session is open and no report is in flight: every decision made is known here."""
        return bool(self.session) and self.inflight is None and self.opening is None

    def send_async(self, room: int, keepalive: bool = False) -> None:
        # The reply in flight is read only by `read_inflight`, which the engine calls before it
        # pins: a reply read here would be followed by the next report with no pin in between.
        books = self.books
        if not self.session:
            self.open_async()
            if self.opening is None or not self.opening.done():
                return
            self._read_opening()  # answered already: report in this same call
            if not self.session:
                return
        if self.inflight is not None:
            return
        if books.events or books.waiting or keepalive:
            if books.pace is not None:
                # Room is what the engine can start once it applied what it holds now: the
                # decisions just read are applied after this call returns.
                room = max(0, room - sum(isinstance(d, Admitted) for d in books.ready))
            # The message is made on the sender thread, while the engine's step goes on.
            self.inflight = self.client.report_async(self.build(room, admit=True).to_wire,
                                                     self.unanswered_s)  # fmt: skip

    def read_inflight(self) -> bool:
        """Absorb the reply in flight if it arrived; True when no report is in flight now."""
        if self.opening is not None:
            self._read_opening()
        if self.inflight is None:
            return True
        if not self.inflight.done():
            return False
        future, self.inflight = self.inflight, None
        try:
            self.books.absorb(future.result())
        except SessionLost:
            self.session = 0  # the sidecar restarted or dropped us: a new session, at once
        except SidecarUnavailable as exc:
            # The sidecar may have applied the report and lost only the reply; a new session
            # rebuilds its ledger from this engine's books either way.
            self._lose(exc)
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc
        return True

    def idle(self) -> float:
        """What a serving engine with no work calls on every idle turn instead of `flush`,
        without waiting: read the reply in flight, send what is pending, keep the session
        (an empty report once a third of the lease has passed, which is also how an idle
        engine finds its sidecar gone) and try to reconnect. Returns how soon (seconds) it
        wants to be called again."""
        self.read_inflight()
        quiet_s = time.monotonic() - self.last_report_at
        self.send_async(0, keepalive=quiet_s > self.lease_ms / 3000)
        busy = self.inflight is not None or self.opening is not None
        return IDLE_BUSY_S if busy else IDLE_QUIET_S

    def draining(self) -> bool:
        """For an engine that would idle with no turn of its own to come (vLLM's, which blocks
        until a request arrives): whether to turn once more so the sidecar hears what is
        pending, which `idle` sends. Yes while a call is in flight, or while events wait for a
        session after a failed call (pausing `DRAIN_PAUSE_S`) until the outage outlasts the
        lease, after which the sidecar no longer holds this session's books anyway."""
        if self.idle() == IDLE_BUSY_S:
            return True
        outage = self.outage
        if not self.books.events or (outage is None and self.session):
            return False
        if outage is not None and time.monotonic() - outage.since > self.lease_ms / 1000:
            return False
        time.sleep(DRAIN_PAUSE_S)
        return True

    def open_async(self) -> None:
        """Start opening a session on the sender thread, unless one is opening or the backoff
        after a failed try has not passed."""
        if self.opening is not None or time.monotonic() < self.next_open_at:
            return
        request = self._open_request()
        # What this request registers counts every event so far; from here on the next
        # report carries the waiting requests again and what happens after this point.
        self.books.events = self._resubmits()
        self.opening = self.client.open_session_async(request, self.unanswered_s)

    def _read_opening(self) -> None:
        assert self.opening is not None
        if not self.opening.done():
            return
        future, self.opening = self.opening, None
        try:
            reply = future.result()
        except SidecarError as exc:
            # Unreachable, or a sidecar that refuses this engine (another pool or policy after
            # its restart): either way the engine cannot admit, and keeps trying.
            self._lose(exc)
            return
        events, outage = self.books.events, self.outage
        self._opened(reply)
        self.books.events = events  # the resubmits, then what happened while it opened
        self.retry_s = self.RETRY_FIRST_S
        if outage is not None:
            self.outage = None
            log.warning(
                "the admission sidecar at %s answers again after %.1f s: session %d re-opened "
                "with %d running requests re-registered; admitting again",
                self.client.address, time.monotonic() - outage.since, self.session,
                len(self.books.running),
            )  # fmt: skip

    def _lose(self, exc: SidecarError) -> None:
        """End the session after a failed call: log the outage once (and again only if its
        status changes) and back off before the next try."""
        self.session, self.inflight = 0, None
        self.books.last_pool = None  # no pin on a headroom the lost ledger reported
        now = time.monotonic()
        self.next_open_at = now + self.retry_s
        self.retry_s = min(self.retry_s * 2, self.RETRY_MAX_S)
        previous = self.outage
        self.outage = Outage(
            self.client.address, exc.code, exc.message, previous.since if previous else now
        )
        if previous is None or previous.code != exc.code:
            log.error(
                "%s; admitting nothing: %s, running requests keep their pages and finish; "
                "retrying every %.1f s at most",
                self.outage.describe(), self.outage_effect, self.RETRY_MAX_S,
            )  # fmt: skip

    # ---- both ------------------------------------------------------------------------------

    def wait_inflight(self) -> None:
        """Wait for the reply in flight, if any, and absorb it."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            try:
                self._opened(opening.result())  # the resubmits queued when it started stay
            except SidecarError as exc:
                raise as_ledger_error(exc) from exc
        if self.inflight is None:
            return
        future, self.inflight = self.inflight, None
        try:
            self.books.absorb(future.result())
        except SessionLost:
            self.open()
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc

    def open(self) -> None:
        """Open a session that re-registers what runs and resubmits what waits (see above)."""
        try:
            reply = self.client.open_session(self._open_request())
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc
        self._opened(reply)
        self.books.events = self._resubmits()

    def _open_request(self) -> pb.OpenSessionRequest:
        books = self.books
        request = pb.OpenSessionRequest(
            engine_id=self.engine_id,
            total_pages=self.total_pages,
            next_seq=books.last_seq + 1,
            running=[
                pb.RunningRequest(rid=rid, reserved=r, held=h)
                for rid, (r, h) in books.running.items()
            ],
            lease_ms=self.lease_ms,
            policy=books.policy,
        )
        if books.pace is not None:
            request.pace.CopyFrom(books.pace)
        if books.supply is not None:
            request.supply.free, request.supply.evictable = books.supply
        return request

    def _opened(self, reply: pb.OpenSessionReply) -> None:
        self.sessions_opened += 1
        self.session, self.report_seq = reply.session, 0
        self.books.last_seq = reply.next_seq - 1
        self.inflight = None
        self.last_report_at = time.monotonic()

    def _resubmits(self) -> list[pb.Event]:
        """A new session's first events: the waiting requests, and the best-effort figures."""
        held, backlog = self.books.best_effort
        events = [pb.Event(submit=submit_to_wire(rid, *w)) for rid, w in self.books.waiting.items()]
        if held or backlog:
            events.append(pb.Event(best_effort=pb.BestEffort(held=held, backlog=backlog)))
        return events
