"""The engine's `LedgerClient` (kvbank.ledger.client) over gRPC: the same events the
embedded ledger gets, sent to the sidecar as one report per `poll`.

Two modes. Blocking (`kvbank bench --sidecar`, virtual time): `try_admit` (or `poll`: the head
of the queue, at most `room` times) sends what happened since the last report with the try and
waits for the answer, so the sidecar's ledger sees
exactly the calls the embedded one would, in the same order, and the run is identical.
Non-blocking (serving, every policy; `later` is this backend): at the start of a step `collect`
reads the reply in flight if it arrived, the engine applies its decisions and, with nothing in
flight (`settled`), pins the head's hit; then `poll` sends the next report and returns at once.
Decisions are applied a step or more after they were made. One report is in flight at a time,
so every reply is read before the next report is built.

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
  open-ended (kvbank.ledger.open_ended) until the engine's `start` event arrives.
- A cancel crossing an admission: `cancel` of a request this backend already saw decided sends
  nothing (the engine releases the admitted request when it applies the decision), and a cancel
  queued while the deciding report was in flight is dropped when that reply arrives.
- The sidecar restarts (SIGKILL) or drops the session: the backend opens a new session that
  re-registers what runs and resubmits what waits, counting nothing twice (how: see
  sidecar/backend_wire.py, which keeps the session, the registry of running requests and
  the wire; this module is the `LedgerClient` API the engine calls).
- The sidecar does not answer at all: non-blocking, the step still never waits; `outage` says
  so (the serving loop answers 503 and fails /health meanwhile), what runs keeps its pages,
  and the next session opens when the sidecar answers again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvbank.ledger import (
    Admitted,
    Decision,
    Hit,
    InvalidPages,
    InvariantBreach,
    PeakPolicy,
    PeakShape,
    UnknownRequest,
)
from kvbank.ledger.client import BestEffortFigures, StepEnd
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.backend_wire import ENGINE_OUTAGE_EFFECT, BackendBooks, Outage, ReportWire
from kvbank.sidecar.client import SidecarClient, SidecarError, unreachable_message
from kvbank.sidecar.wire_forms import hit_to_wire, pace_of, shape_to_wire, submit_to_wire

# A report on loopback takes a millisecond; a sidecar that has not answered one in half a
# second (its retries against a refused connection included) is gone, not slow.
SERVING_UNANSWERED_S = 0.5


class SidecarBackend:
    """What the engine calls: events queue up for the next report, decisions come back from
    `try_admit` (blocking) or `collect` and `poll` (non-blocking); see the module docstring for
    the two modes. Its parts: the books it keeps between reports and the wire that carries
    them (sidecar/backend_wire.py)."""

    def __init__(
        self,
        client: SidecarClient,
        total_pages: int,
        engine_id: str = "engine",
        blocking: bool = True,
        lease_s: float = 10.0,
        unanswered_s: float | None = None,
        outage_effect: str = ENGINE_OUTAGE_EFFECT,
    ) -> None:
        self.blocking = blocking
        self.books = BackendBooks()
        self.wire = ReportWire(
            client, self.books, total_pages, engine_id, lease_s, unanswered_s, outage_effect
        )
        # An idle engine's turns (sidecar/backend_wire.py): kvbank's engine calls `idle`,
        # vLLM's scheduler `draining`.
        self.idle, self.draining = self.wire.idle, self.wire.draining
        self._backfilling = False  # the last in-step answer's

    @property
    def sessions_opened(self) -> int:
        return self.wire.sessions_opened

    @property
    def policy(self) -> str:
        return self.books.policy

    @property
    def last_pool(self) -> pb.PoolFigures | None:
        return self.books.last_pool

    @property
    def later(self) -> SidecarBackend | None:
        """Non-blocking, decisions reach the engine a report later (`LateAnswers`: this
        backend's `collect`, `poll`, `settled`, `pin` and `start`); blocking, every answer comes
        in step."""
        return None if self.blocking else self

    # ---- events (LedgerClient) -------------------------------------------------------------

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        wire = shape_to_wire(shape) if shape is not None else None
        self.books.waiting[rid] = (pages, refusal or "", wire)
        self.books.events.append(pb.Event(submit=submit_to_wire(rid, pages, refusal or "", wire)))

    def cancel(self, rid: str) -> None:
        self.books.hits.pop(rid, None)
        if self.books.waiting.pop(rid, None) is not None:
            self.books.events.append(pb.Event(cancel=pb.Cancel(rid=rid)))

    def take(self, rid: str, pages: int) -> None:
        entry = self.books.running.get(rid)
        if entry is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        if pages < 0 or entry[1] + pages > entry[0]:
            raise InvalidPages(
                f"request {rid!r} would hold {entry[1] + pages} pages but reserved {entry[0]}"
            )
        entry[1] += pages
        self.books.outstanding -= pages
        self.books.supply_in_ledger = False
        self.books.events.append(pb.Event(take=pb.Take(rid=rid, pages=pages)))

    def release(self, rid: str) -> None:
        entry = self.books.running.pop(rid, None)
        if entry is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        self.books.outstanding -= entry[0] - entry[1]
        self.books.events.append(pb.Event(release=pb.Release(rid=rid)))

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        entry = self.books.running.get(rid)
        if entry is None:
            raise UnknownRequest(f"request {rid!r} is not running")
        if not 0 <= held <= min(reserved, entry[1]) or reserved - held > entry[0] - entry[1]:
            raise InvalidPages(
                f"request {rid!r} holds {entry[1]} of its {entry[0]} reserved pages; it cannot "
                f"give back {reserved} reserved pages of which {held} held"
            )
        entry[0] -= reserved
        entry[1] -= held
        self.books.outstanding -= reserved - held
        self.books.supply_in_ledger = False
        event = pb.GiveBack(rid=rid, held=held, reserved=reserved)
        if shape is not None:
            event.shape.CopyFrom(shape_to_wire(shape))
        self.books.events.append(pb.Event(give_back=event))

    def set_supply(
        self, free: int, evictable: int, best_effort: BestEffortFigures | None = None
    ) -> None:
        books = self.books
        if best_effort is not None:
            figures = (best_effort.held, best_effort.backlog)
            if best_effort.arrived or figures != books.best_effort:
                books.best_effort = figures
                books.events.append(pb.Event(best_effort=pb.BestEffort(
                    held=figures[0], backlog=figures[1], arrived=best_effort.arrived)))  # fmt: skip
        if books.supply == (free, evictable) and books.supply_in_ledger:
            return
        books.supply, books.supply_in_ledger = (free, evictable), True
        event = pb.Event(supply=pb.Supply(free=free, evictable=evictable))
        if books.events and books.events[-1].HasField("supply"):
            books.events[-1] = event  # back-to-back supply reports: the last one stands
        else:
            books.events.append(event)

    def outstanding(self) -> int:
        return self.books.outstanding

    def headroom(self) -> int:
        """Pages a pin may take off the supply now: the ledger's headroom in the last reply
        (after its decisions), less what pins took since the report it answers. Releases since
        only add to the true figure, so this never overstates it."""
        known = self.books.last_pool.headroom if self.books.last_pool is not None else 0
        return max(0, known - self.books.pin_cost_inflight - self.books.pin_cost_pending)

    def pin(self, rid: str, pages: int, cost: int, exclusive: Mapping[str, int]) -> None:
        """The head's pinned hit goes with the next report; `cost` (idle pages, and pages one
        request held alone) comes off `headroom` until then."""
        self.books.hits[rid] = Hit(pages, 0, 0)
        self.books.pin_cost_pending += cost
        for held, count in exclusive.items():
            self.books.events.append(pb.Event(exclusive=pb.Exclusive(rid=held, pages=count)))

    # ---- the peak-fit ledger (kvbank.ledger.client.LedgerClient) ------------------

    def configure(self, policy: str, peak: PeakPolicy) -> None:
        """The session this backend opens asks the sidecar for `policy`; a sidecar whose ledger
        runs another answers FAILED_PRECONDITION."""
        if self.wire.session:
            raise InvariantBreach(f"a session is open already; {policy} cannot apply to it")
        self.books.policy, self.books.pace = policy, pace_of(peak)

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None:
        """Blocking: one report carrying what happened since the last one and this one try;
        the answer is the reply's. The engine starts an admission before it asks again, and
        its takes go with the next question. A non-blocking backend never asks in step: its
        engine pins, reports and polls (`later`)."""
        if not self.blocking:
            raise InvariantBreach(
                "a non-blocking backend answers later (`later`): the engine admits through "
                "collect and poll, never by asking in step"
            )
        question = pb.Try(rid=rid, no_room=hit is None)
        if hit is not None:
            question.hit.CopyFrom(hit_to_wire(hit))
        if prefill_chunks is not None:
            question.prefill_chunks = prefill_chunks
        books = self.books
        reply = self.wire.send(self.wire.build(0, admit=True, tries=[question]))
        books.absorb(reply)
        self._backfilling = reply.backfilling
        ready, books.ready = books.ready, []
        answer = None
        for decision in sorted(ready, key=lambda d: d.seq):
            books.applied_seq = max(books.applied_seq, decision.seq)
            if not isinstance(decision, Admitted) or decision.rid != rid:
                raise InvariantBreach(
                    f"asked about {rid!r}, the sidecar answered {decision}: an engine that "
                    f"asks in step refuses what the pool can never hold itself"
                )
            answer = decision
        return answer

    def backfilling(self) -> bool:
        return self._backfilling

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
        return False  # the ledger is the sidecar's: only a question tells

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a request this backend's sidecar admitted (non-blocking peak)."""
        self.books.events.append(pb.Event(start=pb.Start(rid=rid, prefill_chunks=prefill_chunks)))

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int],
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        event = pb.Event()  # filled in place: every running request reports every step
        progress = event.advance
        progress.rid = rid
        progress.tokens_per_label.update(tokens_per_label)
        progress.produced = produced
        progress.chunks_left = chunks_left
        if exclusive is not None:
            progress.exclusive = exclusive
        self.books.events.append(event)

    def end_step(self) -> StepEnd:
        """Blocking: sent at once, so the stalled requests are known now. Non-blocking: they
        come with a later reply, counted in the `stalled_steps` of a later step's end."""
        books = self.books
        books.events.append(pb.Event(end_step=pb.EndStep()))
        if not self.blocking:
            return StepEnd([], books.stalled_steps)
        books.stalled = []
        self.wire.exchange(0, admit=False)
        return StepEnd(books.stalled, books.stalled_steps)

    # ---- decisions -----------------------------------------------------------------------------

    def poll(self, room: int) -> list[Decision]:
        """Send what happened since the last report, with `room`, and return the decisions
        here: blocking, after waiting for the answer; non-blocking, at once (`later`)."""
        if self.blocking:
            self.wire.exchange(room, admit=True)
        else:
            self.wire.send_async(room)
        return self._hand_over()

    def collect(self) -> list[Decision]:
        """The decisions of the report in flight if its reply is here; sends nothing."""
        if not self.blocking:
            self.wire.read_inflight()
        return self._hand_over()

    def settled(self) -> bool:
        """No report in flight: every decision the sidecar made is known here. Only then may
        the engine pin (a decision still on its way may have counted the pages a pin takes).
        Blocking, that is always so between polls; non-blocking, it also needs a session."""
        return self.wire.inflight is None if self.blocking else self.wire.ready

    @property
    def outage(self) -> Outage | None:
        """Non-blocking: why the sidecar cannot be reached now (None: it answers). Safe to read
        from any thread: one reference, replaced whole."""
        return self.wire.outage

    def open_session(self) -> None:
        """Open the session now, waiting for it: `kvbank serve` does at start-up, so a sidecar
        that will not serve this engine (another pool, another policy) ends start-up with the
        sidecar's reason instead of failing the first request. Raises ValueError."""
        try:
            self.wire.open()
        except SidecarError as exc:
            hint = ""
            if exc.code == "FAILED_PRECONDITION":
                hint = (
                    "; `kvbank serve --pool FILE` reads the ModelPool `kvbank sidecar --pool` does"
                )
            raise ValueError(
                f"the sidecar at {self.wire.client.address} refuses this engine ({exc.code}): "
                f"{exc.message}{hint}"
            ) from exc

    def _hand_over(self) -> list[Decision]:
        ready, self.books.ready = self.books.ready, []
        if ready:
            self.books.applied_seq = max(self.books.applied_seq, max(d.seq for d in ready))
        return ready

    def flush(self) -> None:
        """Wait for the report in flight, then send what is pending and wait for that too. For
        an engine going idle or shutting down: a non-blocking backend sends only from `poll`,
        and an engine with no work stops polling. Called on every idle iteration it also keeps
        the session: with nothing pending it sends an empty report once a third of the lease
        has passed, so a live idle engine keeps its session and a hung one loses it. An idle
        engine that never flushes loses its session after the lease; its next report re-opens
        one, restoring what runs, so that costs nothing but the re-open."""
        self.wire.wait_inflight()
        quiet_s = time.monotonic() - self.wire.last_report_at
        if self.books.events or (self.wire.session and quiet_s > self.wire.lease_ms / 3000):
            self.wire.exchange(0, admit=False)

    def check_integrity(self, free: int, evictable: int) -> None:
        """Blocking mode flushes and compares the sidecar's figures with the pool's; both modes
        check the registry's outstanding against the supply."""
        # A peak-fit ledger promises less than the sum of worst cases: its own check (in the
        # sidecar, with --debug) is the one that holds; the figures are compared below.
        if self.books.pace is None and free + evictable < self.books.outstanding:
            raise InvariantBreach(
                f"outstanding {self.books.outstanding} pages exceed supply {free + evictable} "
                f"(free {free} + evictable {evictable})"
            )
        if not self.blocking:
            return
        self.wire.exchange(0, admit=False)
        pool = self.books.last_pool
        if pool is not None and (pool.free, pool.evictable, pool.outstanding) != (
            free,
            evictable,
            self.books.outstanding,
        ):
            raise InvariantBreach(
                f"the sidecar's ledger (free {pool.free}, evictable {pool.evictable}, "
                f"outstanding {pool.outstanding}) differs from the engine's (free {free}, "
                f"evictable {evictable}, outstanding {self.books.outstanding})"
            )


def connect(
    address: str,
    total_pages: int,
    blocking: bool = False,
    token: str | None = None,
    tls_ca: bytes | None = None,
    engine_id: str = "engine",
    tls_server_name: str | None = None,
    verify: bool = False,
    outage_effect: str = ENGINE_OUTAGE_EFFECT,
) -> SidecarBackend:
    """The factory `kvbank serve --sidecar` and `kvbank bench --sidecar` call. `verify` asks the
    sidecar for its status first (token and TLS included) and raises ValueError, saying what to
    fix, when it cannot answer. Non-blocking, a report unanswered for `SERVING_UNANSWERED_S`
    starts an outage (`SidecarBackend.outage`): the engine then refuses new requests at once
    rather than keep them waiting on a ledger it cannot reach (`outage_effect`: what the host
    does instead, for its log line)."""
    client = SidecarClient(address, token=token, tls_ca=tls_ca, tls_server_name=tls_server_name)
    if verify:
        try:
            client.status_reply()
        except SidecarError as exc:
            client.close()
            raise ValueError(unreachable_message(address, exc, token, tls_ca)) from exc
    unanswered_s = None if blocking else SERVING_UNANSWERED_S
    return SidecarBackend(
        client, total_pages, engine_id, blocking, unanswered_s=unanswered_s,
        outage_effect=outage_effect,
    )  # fmt: skip
