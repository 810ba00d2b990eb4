"""The sidecar's admission state behind the client's interface, in the test's own process: the
engine's real `SidecarBackend` talks to the real `AdmissionState`, and only the transport is
replaced, so a test chooses how many polls a reply takes to arrive (a slow loopback)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.state import AdmissionState


class _Later(Future[pb.ReportReply]):
    """A reply decided when the report was sent, seen as done only after `polls` more looks."""

    def __init__(self, reply: pb.ReportReply, polls: int) -> None:
        super().__init__()
        self._reply, self._polls = reply, polls

    def done(self) -> bool:
        if self._polls <= 0 and not super().done():
            self.set_result(self._reply)
        self._polls -= 1
        return super().done()

    def result(self, timeout: float | None = None) -> pb.ReportReply:
        if not super().done():
            self.set_result(self._reply)
        return super().result(timeout)


class InProcessSidecar:
    def __init__(self, state: AdmissionState, lag: Callable[[], int] = lambda: 1) -> None:
        self.state = state
        self.lag = lag
        self.reports = 0

    def open_session(self, request: pb.OpenSessionRequest) -> pb.OpenSessionReply:
        return self.state.open_session(request)

    def report(self, request: pb.ReportRequest) -> pb.ReportReply:
        self.reports += 1
        return self.state.report(request)

    def report_async(
        self, make: Callable[[], pb.ReportRequest], budget_s: float | None = None
    ) -> Future[pb.ReportReply]:
        return _Later(self.report(make()), self.lag())

    def open_session_async(
        self, request: pb.OpenSessionRequest, budget_s: float | None = None
    ) -> Future[pb.OpenSessionReply]:
        opened: Future[pb.OpenSessionReply] = Future()
        opened.set_result(self.open_session(request))
        return opened
