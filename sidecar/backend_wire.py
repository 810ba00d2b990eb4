"""The wire half of `SidecarBackend` (kvbank.sidecar.backend): it builds each report from the
events the engine queued, sends it (waiting, or leaving it in flight), absorbs the reply into the
registry of running requests and the decisions ready for the engine, and (re)opens the session.
One report is in flight at a time, so every reply is read before the next report is built.

The sidecar restarts (SIGKILL) or drops the session: the call fails with ABORTED, and the backend
opens a new session that re-registers every running request with what it reserved and holds
(`Ledger.restore`), then resubmits the waiting ones in FIFO order. Pending events are dropped, not
resent: the registry already counts every take and release, so nothing is lost or counted twice.

The registry of running requests (reserved, held) is what a restore needs; it also answers
`outstanding()` between reports. Admission itself is decided only by the sidecar's ledger.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future

from kvbank.ledger import (
    Admitted,
    Decision,
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    Refused,
    UnknownRequest,
)
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SessionLost, SidecarClient, SidecarError, SidecarUnavailable
from kvbank.sidecar.peakpass import hit_to_wire

_LEDGER_ERRORS: dict[str, type[Exception]] = {
    "INVALID_ARGUMENT": InvalidPages,
    "NOT_FOUND": UnknownRequest,
    "ALREADY_EXISTS": DuplicateRequest,
    "INTERNAL": InvariantBreach,
}


class BackendWire:
    """The state `SidecarBackend` keeps between reports, and the calls that move it over the
    wire; the engine-facing API is the subclass's."""

    def __init__(
        self,
        client: SidecarClient,
        total_pages: int,
        engine_id: str = "engine",
        blocking: bool = True,
        lease_s: float = 10.0,
    ) -> None:
        self.client = client
        self.total_pages = total_pages
        self.engine_id = engine_id
        self.blocking = blocking
        self.lease_ms = int(lease_s * 1000)
        self.sessions_opened = 0
        self._session = 0
        self._report_seq = 0
        # rid -> pages, refusal, shape (for a peak-fit ledger)
        self._waiting: OrderedDict[str, tuple[int, str, pb.PeakShape | None]] = OrderedDict()
        self.policy = "banker"
        self._pace: pb.LedgerPace | None = None
        self._chunks: dict[str, int] = {}  # prefill bounds to send with the next answer
        self._stalled: list[str] = []
        self._stalled_steps = 0
        self._running: dict[str, list[int]] = {}  # rid -> [reserved, held]
        self._outstanding = 0
        self._hits: dict[str, Hit] = {}
        self._events: list[pb.Event] = []
        self._supply: tuple[int, int] | None = None  # the pool's last (free, evictable)
        # Whether the sidecar's ledger holds exactly `_supply`: a take or an admission's lease
        # moves the ledger's own figures, and then the next report must be sent even if the
        # pool reports the same numbers again.
        self._supply_in_ledger = False
        self._ready: list[Decision] = []
        self._inflight: Future[pb.ReportReply] | None = None
        self._inflight_request: pb.ReportRequest | None = None
        self._applied_seq = -1  # last decision handed to the engine
        self._last_seq = -1  # last decision seen
        self.last_pool: pb.PoolFigures | None = None
        self._last_report_at = 0.0
        # Pages pins took off the headroom since the report the last reply answered: in the
        # report in flight, and not yet reported (see `headroom`).
        self._pin_cost_inflight = 0
        self._pin_cost_pending = 0

    def _build(self, room: int, admit: bool) -> pb.ReportRequest:
        if not self._session:
            self._open()
        self._report_seq += 1
        hits = [
            pb.HeadHit(rid=rid, hit=hit_to_wire(h))
            for rid, h in self._hits.items()
            if rid in self._waiting
        ]
        self._pin_cost_inflight += self._pin_cost_pending
        self._pin_cost_pending = 0
        self._last_report_at = time.monotonic()
        request = pb.ReportRequest(
            session=self._session,
            report_seq=self._report_seq,
            applied_seq=self._applied_seq,
            events=self._events,
            hits=hits,
            admit=admit,
            room=room,
        )
        self._events = []
        return request

    def _send(self, request: pb.ReportRequest) -> pb.ReportReply:
        try:
            return self.client.report(request)
        except SessionLost:
            self._open()
            return self._send(self._build(request.room, request.admit))
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc

    def _poll_async(self, room: int) -> None:
        # The reply in flight is read only by `collect`, which the engine calls before it pins:
        # a reply read here would be followed by the next report with no pin in between.
        if self._inflight is not None:
            return
        if self._events or self._waiting:
            if self._pace is not None:
                # Room is what the engine can start once it applied what it holds now: the
                # decisions just read are applied after this call returns.
                room = max(0, room - sum(isinstance(d, Admitted) for d in self._ready))
            self._inflight_request = self._build(room, admit=True)
            self._inflight = self.client.report_async(self._inflight_request)

    def _read_inflight(self) -> bool:
        """Absorb the reply in flight if it arrived; True when no report is in flight now."""
        if self._inflight is None:
            return True
        if not self._inflight.done():
            return False
        future, self._inflight = self._inflight, None
        try:
            self._absorb(future.result())
        except SessionLost:
            self._open()
        except SidecarUnavailable:
            # Keep serving and resend the same report: the sidecar may have applied it and
            # lost only the reply, and a repeated report_seq is answered, not re-applied.
            assert self._inflight_request is not None
            self._inflight = self.client.report_async(self._inflight_request)
            return False
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc
        return True

    def _absorb(self, reply: pb.ReportReply) -> None:
        self.last_pool = reply.pool
        self._pin_cost_inflight = 0  # the reply's headroom counts every pin reported so far
        self._stalled += reply.stalled
        self._stalled_steps = max(self._stalled_steps, reply.stalled_steps)
        cancelled = []
        for d in reply.decisions:
            self._last_seq = max(self._last_seq, d.seq)
            kind = d.WhichOneof("outcome")
            if kind == "restored":
                continue  # the engine runs it already
            if self._waiting.pop(d.rid, None) is None:
                cancelled.append(d.rid)  # cancelled while this report was in flight
            self._hits.pop(d.rid, None)
            if kind == "admit":
                wire = d.admit.hit
                sole = wire.sole_pages if wire.HasField("sole_pages") else None
                hit = Hit(wire.pages, wire.idle_pages, sole)
                self._running[d.rid] = [d.admit.reserved, hit.pages]
                if hit.idle_pages:
                    self._supply_in_ledger = False
                self._outstanding += d.admit.reserved - hit.pages
                self._ready.append(Admitted(d.rid, d.seq, d.admit.reserved, hit))
            else:
                self._ready.append(Refused(d.rid, d.seq, d.refuse.message))
        if cancelled:
            self._events = [
                e for e in self._events if not (e.HasField("cancel") and e.cancel.rid in cancelled)
            ]

    def _open(self) -> None:
        """Open a session that re-registers what runs and resubmits what waits (see above)."""
        request = pb.OpenSessionRequest(
            engine_id=self.engine_id,
            total_pages=self.total_pages,
            next_seq=self._last_seq + 1,
            running=[
                pb.RunningRequest(rid=rid, reserved=r, held=h)
                for rid, (r, h) in self._running.items()
            ],
            lease_ms=self.lease_ms,
            policy=self.policy,
        )
        if self._pace is not None:
            request.pace.CopyFrom(self._pace)
        if self._supply is not None:
            request.supply.free, request.supply.evictable = self._supply
        try:
            reply = self.client.open_session(request)
        except SidecarError as exc:
            raise as_ledger_error(exc) from exc
        self.sessions_opened += 1
        self._session, self._report_seq = reply.session, 0
        self._last_seq = reply.next_seq - 1
        self._inflight = None
        self._events = [
            pb.Event(submit=submit_to_wire(rid, pages, refusal, shape))
            for rid, (pages, refusal, shape) in self._waiting.items()
        ]


def submit_to_wire(rid: str, pages: int, refusal: str, shape: pb.PeakShape | None) -> pb.Submit:
    """A submit event, as `submit` queues it and a re-opened session resends it."""
    submit = pb.Submit(rid=rid, pages=pages, refusal=refusal)
    if shape is not None:
        submit.shape.CopyFrom(shape)
    return submit


def as_ledger_error(exc: SidecarError) -> Exception:
    """The ledger's own error for a status the sidecar mapped from one, so an engine handles a
    remote ledger's refusal as it would the embedded one's; other errors pass unchanged."""
    kind = _LEDGER_ERRORS.get(exc.code)
    return kind(exc.message) if kind is not None else exc
