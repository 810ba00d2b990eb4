"""Property: a report is all-or-nothing. Random batches of events, valid or not, either apply
completely or fail with a ledger error and leave the sidecar's state exactly as it was."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.ledger import LedgerError
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.state import AdmissionState, OutOfOrder

RIDS = ["a", "b", "c", "d", "e"]

events = st.one_of(
    st.builds(
        lambda rid, pages: pb.Event(submit=pb.Submit(rid=rid, pages=pages)),
        st.sampled_from(RIDS),
        st.integers(-2, 60),
    ),
    st.builds(lambda rid: pb.Event(cancel=pb.Cancel(rid=rid)), st.sampled_from(RIDS)),
    st.builds(
        lambda rid, pages: pb.Event(take=pb.Take(rid=rid, pages=pages)),
        st.sampled_from(RIDS),
        st.integers(-1, 20),
    ),
    st.builds(lambda rid: pb.Event(release=pb.Release(rid=rid)), st.sampled_from(RIDS)),
    st.builds(
        lambda free, evictable: pb.Event(supply=pb.Supply(free=free, evictable=evictable)),
        st.integers(-1, 100),
        st.integers(0, 20),
    ),
)
batches = st.lists(
    st.tuples(st.lists(events, max_size=6), st.one_of(st.none(), st.integers(0, 3))),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_every_report_applies_whole_or_not_at_all(batch_list: list) -> None:
    state = AdmissionState(101, DecisionLog(), debug=True)
    session = state.open_session(pb.OpenSessionRequest(total_pages=101)).session
    report_seq, applied = 0, -1
    for batch, room in batch_list:
        before = state.status()
        request = pb.ReportRequest(
            session=session,
            report_seq=report_seq + 1,
            applied_seq=applied,
            events=batch,
            admit=True,
        )
        if room is not None:
            request.room = room
        try:
            reply = state.report(request)
        except (LedgerError, OutOfOrder):
            assert state.status() == before
            continue
        report_seq += 1
        if reply.decisions:
            applied = reply.decisions[-1].seq
        if state.ledger is not None:
            state.ledger.check_integrity()
        after = state.status()
        assert after.pool.outstanding <= after.pool.free + after.pool.evictable
        assert [d.seq for d in reply.decisions] == sorted(d.seq for d in reply.decisions)
        assert after.log_length == after.next_seq  # every decision logged, none twice
