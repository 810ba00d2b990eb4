"""The sidecar's side of a stepwise admission pass (the protocol and its cost:
kvbank.sidecar.peakpass), and how every report ends: the ledger a report produced replaces the
ledger (`_commit`) and its decisions go to the log and the metrics (`_record`).

The round that opens a pass commits the report's events on their own (that ledger becomes
`OpenPass.base`); each later round adds the engine's answer and replays the pass from that base.
The pass's ledger replaces the ledger only when the pass asks nothing more, so a bad answer is
dropped and leaves the ledger as the events left it."""

from __future__ import annotations

from collections.abc import Callable

from kvbank.ledger import Admitted, Ledger, Refused
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.metrics import SidecarMetrics
from kvbank.sidecar.peakpass import check_answer, hit_to_wire
from kvbank.sidecar.reports import fill_pool
from kvbank.sidecar.session import OutOfOrder, Session


class StepwiseRounds:
    """Mixed into `AdmissionState`, which sets these."""

    ledger: Ledger | None
    log: DecisionLog
    metrics: SidecarMetrics
    debug: bool
    _clock: Callable[[], float]
    _arrived: dict[str, float]  # rid -> arrival time, for the wait histogram

    def _resume(
        self,
        req: pb.ReportRequest,
        s: Session,
        committed: tuple[Ledger, list[Admitted | Refused], list[str], list[str]] | None = None,
    ) -> pb.ReportReply:
        """One round of a stepwise pass (see kvbank.sidecar.peakpass). `committed`: the round
        that opens it, with the ledger after that report's events and what they decided."""
        open_pass = s.open_pass
        assert open_pass is not None or committed is None
        if open_pass is None:
            raise OutOfOrder("no admission pass is open; send an admit report to open one")
        if committed is None:
            if not (req.resume and req.admit and req.stepwise):
                raise OutOfOrder(
                    f"an admission pass waits for the hit of {open_pass.asked!r}; answer it "
                    f"with a stepwise admit report with resume set before anything else"
                )
            answer = check_answer(req, open_pass.asked)
            open_pass.answers.append(answer)
            try:
                ledger, admitted, asked = open_pass.replay()
            except BaseException:
                open_pass.answers.pop()
                raise
            decided: list[Admitted | Refused] = []
            arrived: list[str] = []
            stalled: list[str] = []
        else:
            ledger, decided, arrived, stalled = committed
            ledger, admitted, asked = open_pass.replay()
            # The events before the pass stand on their own: a later round replays from here.
            open_pass.base = committed[0]
            self._commit(committed[0])
        if self.debug and not asked:
            ledger.check_integrity()
        now = self._clock()
        s.report_seq, s.applied_seq, s.last_report = req.report_seq, req.applied_seq, now
        for rid in arrived:
            self._arrived[rid] = now
        reply = pb.ReportReply(peek=asked)
        self._record_all(reply, [*decided, *admitted[open_pass.told :]], s, now, s.unapplied_idle)
        open_pass.told, open_pass.asked = len(admitted), asked
        if not asked:  # the pass is over: its ledger is the ledger
            self._commit(ledger)
            s.open_pass = None
            if ledger.head is not None and ledger.promised is None:
                self.metrics.waits.inc()
        reply.waiting = ledger.waiting_count()
        return self._close(reply, req, s, ledger, stalled)

    def _commit(self, ledger: Ledger) -> None:
        """`ledger` replaces the ledger; the steps it closed with a stalled request count."""
        before = self.ledger.stalled_steps if self.ledger is not None else 0
        if ledger.stalled_steps > before:
            self.metrics.stalled_steps.inc(ledger.stalled_steps - before)
        self.ledger = ledger

    def _record_all(
        self,
        reply: pb.ReportReply,
        decisions: list[Admitted | Refused],
        s: Session,
        now: float,
        unapplied: dict[int, int],
    ) -> None:
        """Log the decisions into the reply in sequence order; an admission's idle hit pages
        stay off the reported evictable count until the engine has applied it."""
        for d in sorted(decisions, key=lambda d: d.seq):
            entry = self._record(d, s, now)
            if isinstance(d, Admitted) and d.hit.idle_pages:
                unapplied[d.seq] = d.hit.idle_pages
            reply.decisions.append(entry)

    def _close(
        self, reply: pb.ReportReply, req: pb.ReportRequest, s: Session, ledger: Ledger,
        stalled: list[str],
    ) -> pb.ReportReply:  # fmt: skip
        """The figures every reply carries; kept as the answer to a retry of `req`."""
        fill_pool(reply.pool, ledger, totals=False)
        reply.stalled.extend(stalled)
        reply.stalled_steps = ledger.stalled_steps
        s.last_reply = reply
        s.last_request = req.SerializeToString(deterministic=True)
        return reply

    def _record(self, d: Admitted | Refused, s: Session, now: float) -> pb.Decision:
        entry = pb.Decision(seq=d.seq, rid=d.rid, session=s.id)
        if isinstance(d, Admitted):
            entry.admit.reserved = d.reserved
            entry.admit.hit.CopyFrom(hit_to_wire(d.hit))
            self.metrics.admissions.inc()
            arrived = self._arrived.pop(d.rid, None)
            if arrived is not None:
                self.metrics.admission_wait.observe(now - arrived)
        else:
            entry.refuse.message = d.message
            self.metrics.rejections.inc()
        self.log.append(entry)
        return entry
