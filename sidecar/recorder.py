"""How every report of the sidecar ends: its decisions go to the log and the metrics, and the
figures every reply carries are filled in and kept as the answer to a retry (`Recorder`, a part
of `AdmissionState` in sidecar/state.py)."""

from __future__ import annotations

from kvbank.ledger import Admitted, Ledger, Refused
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.metrics import SidecarMetrics
from kvbank.sidecar.reports import fill_pool
from kvbank.sidecar.session import Session
from kvbank.sidecar.wire_forms import hit_to_wire


class Recorder:
    """The decision log, the metrics and the arrival times, and what a report's end writes to
    them: a part of `AdmissionState`."""

    def __init__(self, log: DecisionLog, metrics: SidecarMetrics) -> None:
        self.log = log
        self.metrics = metrics
        self.arrived: dict[str, float] = {}  # rid -> arrival time, for the wait histogram

    def arrive(self, rids: list[str], now: float) -> None:
        """A report's arrivals. A request the engine moved back in the queue (cancelled, then
        submitted again in the same report: vLLM's prefix order) keeps its first arrival."""
        for rid in rids:
            self.arrived.setdefault(rid, now)

    def forget_left(self, ledger: Ledger) -> None:
        """After a report's decisions are recorded (each admission's wait observed): forget the
        arrivals of requests that left unadmitted, so cancelled requests do not pile up."""
        if len(self.arrived) > ledger.waiting_count():
            self.arrived = {r: t for r, t in self.arrived.items() if r in ledger.books.waiting}

    def stalled(self, before: Ledger | None, after: Ledger) -> None:
        """The steps `after` closed with a stalled request since `before`, counted."""
        steps = before.stalled_steps if before is not None else 0
        if after.stalled_steps > steps:
            self.metrics.stalled_steps.inc(after.stalled_steps - steps)

    def record_all(
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
            entry = self.record(d, s, now)
            if isinstance(d, Admitted) and d.hit.idle_pages:
                unapplied[d.seq] = d.hit.idle_pages
            reply.decisions.append(entry)

    def close(
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

    def record(self, d: Admitted | Refused, s: Session, now: float) -> pb.Decision:
        entry = pb.Decision(seq=d.seq, rid=d.rid, session=s.id)
        if isinstance(d, Admitted):
            entry.admit.reserved = d.reserved
            entry.admit.hit.CopyFrom(hit_to_wire(d.hit))
            self.metrics.admissions.inc()
            arrived = self.arrived.pop(d.rid, None)
            if arrived is not None:
                self.metrics.admission_wait.observe(now - arrived)
        else:
            entry.refuse.message = d.message
            self.metrics.rejections.inc()
        self.log.append(entry)
        return entry
