"""The sidecar's admission state: one engine session around one `Ledger`, and the decision log.

Everything here runs on the server's event loop, one call at a time, so no locks are needed.

Races between deciding (here) and applying (in the engine, one step later when it does not wait):

- A supply report is measured by the engine before it applied the decisions it has not read
  yet. An admission leased its idle hit pages in the ledger (`evictable -= idle`), but the
  engine's pool still counts them evictable until it applies the admission. Taking the report
  as is would give those pages out twice. So every report carries `applied_seq`, the last
  decision the engine applied, and the idle pages of later admissions are taken off the
  reported evictable count before `set_supply`. Nothing else differs between a decided and an
  applied admission: the engine allocates nothing for a request before applying it.
- A hit a try reports must still be there when the admission is applied: the engine pins the
  pages of the hits it reports until the next report.
- A peak-fit admission starts when the engine reads it, a step or more after it was decided:
  every admission of a report not marked `in_step` is deferred (`Ledger.try_admit(deferred=
  True)`), open-ended until the engine's `start` event, so no start is ever late for the ledger.
  An engine that waits for the reply (`in_step`) starts what it admits before its next report.
- A cancel for a request already admitted (decided while the cancel was on its way) is the
  engine's to turn into a release: the engine sends one report at a time and reads every
  decision before it builds the next, so it knows what was admitted.
- Retried reports (a lost reply) carry the same `report_seq` and get the first answer again;
  nothing is applied twice.

A report is all-or-nothing: it is applied to a copy of the ledger, which replaces the ledger
only when every event succeeded, so bad input leaves the ledger as it was.

This module keeps the session's life (open, expire), a report's checks and commit, and status.
The session record and its errors are in sidecar/session.py, what the events and tries do to a
ledger in sidecar/reports.py, and how a report's decisions are recorded in sidecar/recorder.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from kvbank.ledger import InvalidPages, Ledger
from kvbank.mode import AdmissionMode
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.limits import check_open, check_report
from kvbank.sidecar.metrics import SidecarMetrics
from kvbank.sidecar.recorder import Recorder
from kvbank.sidecar.reports import (
    DEFAULT_MAX_WAITING,
    answer_tries,
    apply_events,
    fill_pool,
)
from kvbank.sidecar.session import OutOfOrder, PolicyMismatch, PoolMismatch, Session, SessionGone
from kvbank.sidecar.wire_forms import peak_policy

__all__ = [
    "AdmissionState",
    "OutOfOrder",
    "PolicyMismatch",
    "PoolMismatch",
    "Session",
    "SessionGone",
    "fill_pool",
]


class AdmissionState:
    """The state the sidecar's service serves: one engine session, its ledger, and the recorder
    of its decisions (the log and the metrics)."""

    def __init__(
        self,
        pool_pages: int | None = None,
        log: DecisionLog | None = None,
        debug: bool = False,
        default_lease_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        policy: str | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        # None: no pool and no --policy given; each session runs the ledger its engine asks for.
        self.policy = None if policy is None else AdmissionMode.parse(policy).name
        self.max_waiting = max_waiting
        self.pool_pages = pool_pages
        self.debug = debug
        self.default_lease_s = default_lease_s
        self._clock = clock
        self.log = log if log is not None else DecisionLog()  # an empty log is falsy
        self.ledger: Ledger | None = Ledger(pool_pages, debug=debug) if pool_pages else None
        self.session: Session | None = None
        self.metrics = SidecarMetrics(lambda: self.ledger)
        self.recorder = Recorder(self.log, self.metrics)
        self._session_ids = itertools.count(int(time.time() * 1000) << 8)
        # Called after each change of the books with the pickers' holds the change submitted
        # (sidecar/routing.py streams the figures to pickers).
        self.on_change: list[Callable[[list[str]], None]] = []
        # The engine's best-effort (held, backlog) pages, its last `BestEffort` event's: never
        # the ledger's, read by the pickers' figures.
        self.best_effort = (0, 0)

    def _changed(self, submitted: list[str] | None = None) -> None:
        for call in self.on_change:
            call(submitted or [])

    # ---- the engine session --------------------------------------------------------------------

    def open_session(self, req: pb.OpenSessionRequest) -> pb.OpenSessionReply:
        check_open(req)
        if self.pool_pages is not None and req.total_pages != self.pool_pages:
            raise PoolMismatch(
                f"the engine runs a pool of {req.total_pages} pages but this sidecar was "
                f"started for {self.pool_pages}; start both from the same ModelPool"
            )
        if req.next_seq < 0 or req.lease_ms < 0:
            raise InvalidPages(
                f"next_seq {req.next_seq} and lease_ms {req.lease_ms} must not be negative"
            )
        asked = req.policy or "banker"
        if self.policy is not None and asked != self.policy:
            raise PolicyMismatch(
                f"the engine admits by the {asked} policy but this sidecar's ledger runs "
                f"{self.policy}; start the sidecar with --policy {asked} (or the pool's "
                f"spec.admission), or run the engine with --policy {self.policy}"
            )
        peak = peak_policy(asked, req.pace if req.HasField("pace") else None)
        # Restored without the debug check after each: their sum is the engine's claim, checked
        # once below as input; only then does a breach mean the ledger's own.
        ledger = Ledger(req.total_pages, next_seq=req.next_seq, policy=peak)
        if req.HasField("supply"):
            ledger.set_supply(req.supply.free, req.supply.evictable)
        restored = [ledger.restore(r.rid, r.reserved, r.held) for r in req.running]
        check_restored(ledger, len(restored))
        ledger.check_integrity()
        ledger.debug = self.debug
        # Every check passed: only now does the old session (and its reservations) go.
        if self.session is not None:
            self.metrics.sessions_dropped.inc()
        lease_s = req.lease_ms / 1000 if req.lease_ms else self.default_lease_s
        self.session = Session(next(self._session_ids), req.engine_id, lease_s, self._clock())
        self.ledger = ledger
        self.best_effort = (0, 0)
        self.recorder.arrived.clear()
        self.log.reset(req.next_seq)
        for res in restored:
            self.log.append(
                pb.Decision(
                    seq=res.seq,
                    rid=res.rid,
                    session=self.session.id,
                    restored=pb.Restored(reserved=res.reserved, held=res.held),
                )
            )
        self._changed()
        return pb.OpenSessionReply(session=self.session.id, next_seq=ledger.next_seq)

    def expire(self) -> bool:
        """Drop the session whose engine stopped reporting: its reservations go with it, so a
        dead engine cannot hold the pool. Returns whether one was dropped."""
        s = self.session
        if s is None or self._clock() - s.last_report <= s.lease_s:
            return False
        self.session = None
        self.ledger = Ledger(self.pool_pages, debug=self.debug) if self.pool_pages else None
        self.best_effort = (0, 0)
        self.recorder.arrived.clear()
        self.metrics.sessions_dropped.inc()
        self._changed()
        return True

    # ---- reports -------------------------------------------------------------------------------

    def report(self, req: pb.ReportRequest) -> pb.ReportReply:
        s = self.session
        if s is None or req.session != s.id or self.ledger is None:
            raise SessionGone(
                f"session {req.session} is not open here (current: "
                f"{s.id if s else 'none'}); open a new session and re-register what runs"
            )
        check_report(req)
        if req.report_seq == s.report_seq and s.last_reply is not None:
            if req.SerializeToString(deterministic=True) != s.last_request:
                raise OutOfOrder(
                    f"report {req.report_seq} was already applied with other content; number "
                    f"a new report {s.report_seq + 1}"
                )
            s.last_report = self._clock()
            return s.last_reply  # a retry: the first answer, nothing applied twice
        if req.report_seq != s.report_seq + 1:
            raise OutOfOrder(
                f"report {req.report_seq} arrived after report {s.report_seq}; reports must "
                f"be numbered {s.report_seq + 1}, {s.report_seq + 2}, ..."
            )
        last_decided = self.ledger.next_seq - 1
        if not s.applied_seq <= req.applied_seq <= last_decided:
            raise OutOfOrder(
                f"applied_seq {req.applied_seq} must lie between the last applied "
                f"{s.applied_seq} and the last decision made {last_decided}"
            )
        if req.HasField("room") and req.room < 0:
            raise InvalidPages(f"room must not be negative, got {req.room}")
        if req.HasField("try_first") and (req.try_first < 0 or req.tries or req.in_step):
            raise InvalidPages(
                f"try_first must be a count >= 0 (got {req.try_first}), in a report with no "
                f"tries that is not answered in step; send either tries or try_first"
            )

        unapplied = {q: i for q, i in s.unapplied_idle.items() if q > req.applied_seq}
        # A lone question with nothing before it changes the ledger only if it succeeds (a try
        # checks everything first): no copy to go back to, so a pass costs O(questions).
        lone = req.in_step and not req.events and not req.progress and len(req.tries) <= 1
        ledger = self.ledger if lone else self.ledger.copy()
        now = self._clock()
        decisions, arrived, stalled = apply_events(ledger, req, unapplied, self.max_waiting)
        waited = False
        if req.admit:
            admitted, waited = answer_tries(ledger, req)
            decisions.extend(admitted)
        if self.debug and not (req.admit and req.in_step):  # mid-step, a pass is still open
            ledger.check_integrity()

        # Every event succeeded: commit.
        self._commit(ledger)
        s.report_seq, s.applied_seq, s.last_report = req.report_seq, req.applied_seq, now
        self.recorder.arrive(arrived, now)
        reply = pb.ReportReply(waiting=ledger.waiting_count(), backfilling=ledger.backfilling())
        self.recorder.record_all(reply, decisions, s, now, unapplied)
        self.recorder.forget_left(ledger)
        s.unapplied_idle = unapplied
        if waited:
            self.metrics.waits.inc()
        reply = self.recorder.close(reply, req, s, ledger, stalled)
        # Requests the engine queued take their picker's holds' place: the ledger's (submits)
        # and the best-effort ones (never the ledger's), whose figures the last event gives.
        queued: list[str] = []
        for event in req.events:
            if event.HasField("submit"):
                queued.append(event.submit.hold or event.submit.rid)
            elif event.HasField("best_effort"):
                self.best_effort = (event.best_effort.held, event.best_effort.backlog)
                queued.extend(event.best_effort.arrived)
        if self.on_change:
            self._changed(queued)
        return reply

    def _commit(self, ledger: Ledger) -> None:
        """`ledger` replaces the ledger; the steps it closed with a stalled request count."""
        self.recorder.stalled(self.ledger, ledger)
        self.ledger = ledger

    # ---- status --------------------------------------------------------------------------------

    def status(self) -> pb.StatusReply:
        reply = pb.StatusReply(
            session=self.session.id if self.session else 0,
            log_first_seq=self.log.first_seq,
            log_length=len(self.log),
            next_seq=self.log.next_seq,
        )
        for fid, mark in sorted(self.log.followers.items()):
            reply.followers.add(follower_id=fid, acked_seq=mark.acked_seq)
        if self.ledger is None:
            return reply
        snap = self.ledger.snapshot()
        fill_pool(reply.pool, self.ledger)
        reply.next_seq = snap.next_seq
        for rid, pages in snap.waiting:
            reply.waiting.add(rid=rid, pages=pages)
        for res in snap.running:
            reply.running.add(rid=res.rid, reserved=res.reserved, held=res.held, seq=res.seq)
        return reply


def check_restored(ledger: Ledger, count: int) -> None:
    """Refuse restored promises the pool's reported supply cannot keep. Restored requests count
    at their worst case (nothing of them returns), so every reading of the ledger comes down to
    `outstanding <= supply`; past it the engine sent figures no sidecar admitted, which is bad
    input (INVALID_ARGUMENT), not a breach of the ledger's own promises."""
    if ledger.outstanding > ledger.supply:
        raise InvalidPages(
            f"the {count} restored requests may still take {ledger.outstanding} pages but the "
            f"pool reports {ledger.supply} (free {ledger.free} + evictable {ledger.evictable}); "
            f"re-register only what the engine runs, each with the reserved and held pages it "
            f"was admitted with, and the pool's own supply",
            "running",
        )
