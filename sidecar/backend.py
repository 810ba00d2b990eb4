"""The engine's `AdmissionBackend` (kvbank.engine.admission) over gRPC: the same events the
embedded ledger gets, sent to the sidecar as one report per `poll`.

Two modes. Blocking (`kvbank bench --sidecar`, virtual time): `poll` sends what happened since
the last poll and waits for this step's answer, so the sidecar's ledger sees exactly the calls
the embedded one would, in the same order, and the run is identical. Non-blocking (serving,
every policy): at the start of a step `collect` reads the reply in flight if it arrived, the
engine applies its decisions and, with nothing in flight (`settled`), pins the head's hit; then
`poll` sends the next report and returns at once. Decisions are applied a step or more after
they were made. One report is in flight at a time, so every reply is read before the next
report is built.

Races, and why they are safe:
- Supply reported before a decision is applied: the report carries `applied_seq` and the sidecar
  keeps idle pages leased by later admissions off the reported evictable count (see
  kvbank.sidecar.state). The banker policy pins reported hits with no idle part, so that
  correction is zero for it; it matters for an engine that reports idle hits.
- A hit must still be there when its admission is applied: the engine pins what it reports.
- A pin takes pages off the supply (and, under peak-fit, off a holder's returns), so it may use
  only slack no decision has counted: the engine pins only while no report is in flight, within
  the `headroom` of the last reply less what pins took since (banker: supply - outstanding).
- Under peak-fit a decision starts some steps after it was made: the sidecar's ledger keeps it
  open-ended (kvbank.peaktimeline.open_ended) until the engine's `start` event arrives.
- A cancel crossing an admission: `cancel` of a request this backend already saw decided sends
  nothing (the engine releases the admitted request when it applies the decision), and a cancel
  queued while the deciding report was in flight is dropped when that reply arrives.
- The sidecar restarts (SIGKILL) or drops the session: the call fails with ABORTED, and the
  backend opens a new session that re-registers every running request with what it reserved and
  holds (`Ledger.restore`), then resubmits the waiting ones in FIFO order. Pending events are
  dropped, not resent: the registry below already counts every take and release, so nothing is
  lost or counted twice.

The registry of running requests (reserved, held) is what a restore needs; it also answers
`outstanding()` between reports. Admission itself is decided only by the sidecar's ledger.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
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
from kvbank.peakfit import PeakShape
from kvbank.peaktimeline import PeakPolicy
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SessionLost, SidecarClient, SidecarError, SidecarUnavailable
from kvbank.sidecar.peakpass import hit_to_wire, pace_of, shape_to_wire

_LEDGER_ERRORS: dict[str, type[Exception]] = {
    "INVALID_ARGUMENT": InvalidPages,
    "NOT_FOUND": UnknownRequest,
    "ALREADY_EXISTS": DuplicateRequest,
    "INTERNAL": InvariantBreach,
}


class SidecarBackend:
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

    @property
    def defers(self) -> bool:
        """Whether decisions reach the engine a report later (the engine does not wait)."""
        return not self.blocking

    # ---- events (AdmissionBackend) -------------------------------------------------------------

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        wire = shape_to_wire(shape) if shape is not None else None
        self._waiting[rid] = (pages, refusal or "", wire)
        self._events.append(pb.Event(submit=_submit(rid, pages, refusal or "", wire)))

    def cancel(self, rid: str) -> None:
        self._hits.pop(rid, None)
        self._chunks.pop(rid, None)
        if self._waiting.pop(rid, None) is not None:
            self._events.append(pb.Event(cancel=pb.Cancel(rid=rid)))

    def report_hits(self, hits: Mapping[str, Hit]) -> None:
        self._hits.update(hits)

    def take(self, rid: str, pages: int) -> None:
        entry = self._running.get(rid)
        if entry is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        if pages < 0 or entry[1] + pages > entry[0]:
            raise InvalidPages(
                f"request {rid!r} would hold {entry[1] + pages} pages but reserved {entry[0]}"
            )
        entry[1] += pages
        self._outstanding -= pages
        self._supply_in_ledger = False
        self._events.append(pb.Event(take=pb.Take(rid=rid, pages=pages)))

    def release(self, rid: str) -> None:
        entry = self._running.pop(rid, None)
        if entry is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        self._outstanding -= entry[0] - entry[1]
        self._events.append(pb.Event(release=pb.Release(rid=rid)))

    def set_supply(self, free: int, evictable: int) -> None:
        if self._supply == (free, evictable) and self._supply_in_ledger:
            return
        self._supply, self._supply_in_ledger = (free, evictable), True
        event = pb.Event(supply=pb.Supply(free=free, evictable=evictable))
        if self._events and self._events[-1].HasField("supply"):
            self._events[-1] = event  # back-to-back supply reports: the last one stands
        else:
            self._events.append(event)

    def outstanding(self) -> int:
        return self._outstanding

    def headroom(self) -> int:
        """Pages a pin may take off the supply now: the ledger's headroom in the last reply
        (after its decisions), less what pins took since the report it answers. Releases since
        only add to the true figure, so this never overstates it."""
        known = self.last_pool.headroom if self.last_pool is not None else 0
        return max(0, known - self._pin_cost_inflight - self._pin_cost_pending)

    def note_pin(self, cost: int) -> None:
        """A pin took `cost` pages of headroom (idle pages, and pages one request held alone)."""
        self._pin_cost_pending += cost

    # ---- the peak-fit ledger (kvbank.engine.admission.PeakBackend) -----------------------------

    def configure(self, policy: str, peak: PeakPolicy) -> None:
        """The session this backend opens asks the sidecar for `policy`; a sidecar whose ledger
        runs another answers FAILED_PRECONDITION."""
        if self._session:
            raise InvariantBreach(f"a session is open already; {policy} cannot apply to it")
        self.policy, self._pace = policy, pace_of(peak)

    def set_prefill_chunks(self, rid: str, chunks: int) -> None:
        self._chunks[rid] = chunks
        entry = self._waiting.get(rid)
        if entry is not None and entry[2] is not None:
            entry[2].prefill_chunks = chunks  # a resubmission after a reconnect sends it

    def admit_pass(
        self, peek: Callable[[str], Hit | None], started: Callable[[Admitted], None]
    ) -> None:
        """A stepwise pass (kvbank.sidecar.peakpass): the sidecar names each candidate, this
        engine starts what was admitted and answers. Blocking only: the answer depends on the
        engine's state at the question, which a later step no longer has."""
        if not self.blocking:
            raise InvariantBreach(
                f"the {self.policy} policy admits through the sidecar with a blocking backend "
                f"only; use --policy banker for a non-blocking engine"
            )
        request = self._build(0, admit=True)
        request.stepwise = True
        while True:
            reply = self._send(request)
            self._absorb(reply)
            ready, self._ready = self._ready, []
            for decision in sorted(ready, key=lambda d: d.seq):
                self._applied_seq = max(self._applied_seq, decision.seq)
                if not isinstance(decision, Admitted):
                    raise InvariantBreach(f"the sidecar refused {decision.rid!r}: {decision}")
                started(decision)
            if not reply.peek:
                return
            hit = peek(reply.peek)
            head = pb.HeadHit(rid=reply.peek, stop=hit is None)
            if hit is not None:
                head.hit.CopyFrom(hit_to_wire(hit))
            chunks = self._chunks.pop(reply.peek, None)
            if chunks is not None:
                head.prefill_chunks = chunks
            self._hits.clear()
            request = self._build(0, admit=True)
            request.stepwise = request.resume = True
            request.hits.append(head)

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a request this backend's sidecar admitted (non-blocking peak)."""
        self._events.append(pb.Event(start=pb.Start(rid=rid, prefill_chunks=prefill_chunks)))

    def set_exclusive(self, rid: str, pages: int) -> None:
        self._events.append(pb.Event(exclusive=pb.Exclusive(rid=rid, pages=pages)))

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int],
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        progress = pb.Progress(
            rid=rid,
            tokens_per_label=tokens_per_label,
            produced=produced,
            chunks_left=chunks_left,
        )
        if exclusive is not None:
            progress.exclusive = exclusive
        self._events.append(pb.Event(advance=progress))

    def end_step(self) -> list[str]:
        """Blocking: sent at once, so the stalled requests are known now. Non-blocking: they
        come with a later reply (`stalled_steps`)."""
        self._events.append(pb.Event(end_step=pb.EndStep()))
        if not self.blocking:
            return []
        self._stalled = []
        self._absorb(self._send(self._build(0, admit=False)))
        return self._stalled

    def stalled_steps(self) -> int:
        return self._stalled_steps

    # ---- decisions -----------------------------------------------------------------------------

    def poll(self, room: int) -> list[Decision]:
        if self.blocking:
            self._absorb(self._send(self._build(room, admit=True)))
        else:
            self._poll_async(room)
        return self._hand_over()

    def collect(self) -> list[Decision]:
        """The decisions of the report in flight if its reply is here; sends nothing."""
        if not self.blocking:
            self._read_inflight()
        return self._hand_over()

    def settled(self) -> bool:
        """No report in flight: every decision the sidecar made is known here. Only then may
        the engine pin (a decision still on its way may have counted the pages a pin takes)."""
        return self._inflight is None

    def _hand_over(self) -> list[Decision]:
        ready, self._ready = self._ready, []
        if ready:
            self._applied_seq = max(self._applied_seq, max(d.seq for d in ready))
        return ready

    def flush(self) -> None:
        """Wait for the report in flight, then send what is pending and wait for that too. For
        an engine going idle or shutting down: a non-blocking backend sends only from `poll`,
        and an engine with no work stops polling. Called on every idle iteration it also keeps
        the session: with nothing pending it sends an empty report once a third of the lease
        has passed, so a live idle engine keeps its session and a hung one loses it. An idle
        engine that never flushes loses its session after the lease; its next report re-opens
        one, restoring what runs, so that costs nothing but the re-open."""
        if self._inflight is not None:
            future, self._inflight = self._inflight, None
            try:
                self._absorb(future.result())
            except SessionLost:
                self._open()
            except SidecarError as exc:
                raise _as_ledger_error(exc) from exc
        quiet_s = time.monotonic() - self._last_report_at
        if self._events or (self._session and quiet_s > self.lease_ms / 3000):
            self._absorb(self._send(self._build(0, admit=False)))

    def check_integrity(self, free: int, evictable: int) -> None:
        """Blocking mode flushes and compares the sidecar's figures with the pool's; both modes
        check the registry's outstanding against the supply."""
        # A peak-fit ledger promises less than the sum of worst cases: its own check (in the
        # sidecar, with --debug) is the one that holds; the figures are compared below.
        if self._pace is None and free + evictable < self._outstanding:
            raise InvariantBreach(
                f"outstanding {self._outstanding} pages exceed supply {free + evictable} (free "
                f"{free} + evictable {evictable})"
            )
        if not self.blocking:
            return
        self._absorb(self._send(self._build(0, admit=False)))
        pool = self.last_pool
        if pool is not None and (pool.free, pool.evictable, pool.outstanding) != (
            free,
            evictable,
            self._outstanding,
        ):
            raise InvariantBreach(
                f"the sidecar's ledger (free {pool.free}, evictable {pool.evictable}, "
                f"outstanding {pool.outstanding}) differs from the engine's (free {free}, "
                f"evictable {evictable}, outstanding {self._outstanding})"
            )

    # ---- the wire ------------------------------------------------------------------------------

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
            raise _as_ledger_error(exc) from exc

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
            raise _as_ledger_error(exc) from exc
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
            raise _as_ledger_error(exc) from exc
        self.sessions_opened += 1
        self._session, self._report_seq = reply.session, 0
        self._last_seq = reply.next_seq - 1
        self._inflight = None
        self._events = [
            pb.Event(submit=_submit(rid, pages, refusal, shape))
            for rid, (pages, refusal, shape) in self._waiting.items()
        ]


def _submit(rid: str, pages: int, refusal: str, shape: pb.PeakShape | None) -> pb.Submit:
    submit = pb.Submit(rid=rid, pages=pages, refusal=refusal)
    if shape is not None:
        submit.shape.CopyFrom(shape)
    return submit


def _as_ledger_error(exc: SidecarError) -> Exception:
    kind = _LEDGER_ERRORS.get(exc.code)
    return kind(exc.message) if kind is not None else exc


def connect(
    address: str,
    total_pages: int,
    blocking: bool = False,
    token: str | None = None,
    tls_ca: bytes | None = None,
    engine_id: str = "engine",
) -> SidecarBackend:
    """The factory `kvbank serve --sidecar` and `kvbank bench --sidecar` call."""
    client = SidecarClient(address, token=token, tls_ca=tls_ca)
    return SidecarBackend(client, total_pages, engine_id=engine_id, blocking=blocking)
