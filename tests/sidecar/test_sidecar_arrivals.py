"""The sidecar's admission-wait figure (`kvbank_admission_wait_seconds`) when the engine moves
a waiting request back in the queue (vLLM's prefix order: a cancel and a submit of the same
request in one report) and when requests leave unadmitted: the wait counts from the request's
first arrival, and the arrivals of requests that left are not kept."""

from __future__ import annotations

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.state import AdmissionState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def submit(rid: str, pages: int) -> pb.Event:
    return pb.Event(submit=pb.Submit(rid=rid, pages=pages))


def cancel(rid: str) -> pb.Event:
    return pb.Event(cancel=pb.Cancel(rid=rid))


def supply(free: int) -> pb.Event:
    return pb.Event(supply=pb.Supply(free=free, evictable=0))


class Engine:
    """Reports to an `AdmissionState`, in order, asking for admission each time."""

    def __init__(self, state: AdmissionState) -> None:
        self.state = state
        self.session = state.open_session(pb.OpenSessionRequest(total_pages=11)).session
        self.seq = 0
        self.applied = -1

    def report(self, *events: pb.Event) -> list[str]:
        self.seq += 1
        reply = self.state.report(pb.ReportRequest(
            session=self.session, report_seq=self.seq, applied_seq=self.applied,
            events=events, admit=True, room=4,
        ))  # fmt: skip
        admitted = [d.rid for d in reply.decisions if d.HasField("admit")]
        if reply.decisions:
            self.applied = reply.decisions[-1].seq
        return admitted


def wait_sum(state: AdmissionState) -> tuple[float, float]:
    """The histogram's count and sum."""
    (metric,) = [m for m in state.metrics.registry.collect()
                 if m.name == "kvbank_admission_wait_seconds"]  # fmt: skip
    samples = {s.name: s.value for s in metric.samples}
    return samples["kvbank_admission_wait_seconds_count"], samples[
        "kvbank_admission_wait_seconds_sum"
    ]


def test_a_moved_request_waits_from_its_first_arrival() -> None:
    clock = Clock()
    state = AdmissionState(11, DecisionLog(), debug=True, clock=clock)
    engine = Engine(state)
    assert engine.report(supply(2), submit("x", 5), submit("y", 5)) == []
    clock.now = 4.0
    assert engine.report(cancel("x"), submit("x", 5)) == []  # x moved behind y
    assert [rid for rid, _ in state.ledger.snapshot().waiting] == ["y", "x"]
    clock.now = 9.0
    assert engine.report(supply(10)) == ["y", "x"]
    assert wait_sum(state) == (2.0, 18.0)  # 9 s each: x's wait is not cut to 5 s by its move


def test_requests_that_leave_unadmitted_are_not_remembered() -> None:
    clock = Clock()
    state = AdmissionState(11, DecisionLog(), debug=True, clock=clock)
    engine = Engine(state)
    engine.report(supply(2), *(submit(f"r{i}", 5) for i in range(50)))
    engine.report(*(cancel(f"r{i}") for i in range(1, 50)))
    assert set(state.recorder.arrived) == {"r0"}
    clock.now = 3.0
    assert engine.report(supply(10)) == ["r0"]
    assert state.recorder.arrived == {}
    assert wait_sum(state) == (1.0, 3.0)
