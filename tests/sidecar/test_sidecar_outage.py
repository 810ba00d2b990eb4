"""A non-blocking `SidecarBackend` losing its sidecar and finding a new one: the real backend and
the real `AdmissionState`, with only the transport in-process so a test decides when a call
fails (the sidecar gone) and when a session's opening is answered. The engine's events go on
meanwhile; the new ledger must end with exactly the engine's books."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import pytest

from kvbank.ledger import Admitted
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarError, SidecarUnavailable
from kvbank.sidecar.state import AdmissionState, PoolMismatch

PAGES = 64
T = TypeVar("T")


class FlakySidecar:
    """An `AdmissionState` behind the client's calls; `down` makes every call fail UNAVAILABLE,
    `hold_opening` leaves the next session's opening unanswered until `answer_opening`."""

    address = "127.0.0.1:50051"

    def __init__(self) -> None:
        self.state = AdmissionState(pool_pages=PAGES, debug=True)
        self.down = False
        self.hold_opening = False
        self.held: tuple[Future[pb.OpenSessionReply], pb.OpenSessionRequest] | None = None

    def _check(self) -> None:
        if self.down:
            raise SidecarUnavailable("UNAVAILABLE", "Connection refused")

    def open_session(
        self, request: pb.OpenSessionRequest, budget_s: float | None = None
    ) -> pb.OpenSessionReply:
        self._check()
        try:
            return self.state.open_session(request)
        except PoolMismatch as exc:  # as the service maps it
            raise SidecarError("FAILED_PRECONDITION", str(exc)) from exc

    def report(self, request: pb.ReportRequest, budget_s: float | None = None) -> pb.ReportReply:
        self._check()
        return self.state.report(request)

    def report_async(
        self, make: Callable[[], pb.ReportRequest], budget_s: float | None = None
    ) -> Future[pb.ReportReply]:
        return _settled(lambda: self.report(make()))

    def open_session_async(
        self, request: pb.OpenSessionRequest, budget_s: float | None = None
    ) -> Future[pb.OpenSessionReply]:
        if self.hold_opening:
            self.held = (Future(), request)
            return self.held[0]
        return _settled(lambda: self.open_session(request))

    def answer_opening(self) -> None:
        assert self.held is not None
        future, request = self.held
        future.set_result(self.open_session(request))
        self.held = None

    def restart(self) -> None:
        """A new sidecar process on the same address: an empty ledger."""
        self.state = AdmissionState(pool_pages=PAGES, debug=True)
        self.down = False


def _settled(call: Callable[[], T]) -> Future[T]:
    future: Future[T] = Future()
    try:
        future.set_result(call())
    except Exception as exc:
        future.set_exception(exc)
    return future


def running(state: AdmissionState) -> list[tuple[str, int, int]]:
    return [(r.rid, r.reserved, r.held) for r in state.status().running]


def admit(backend: SidecarBackend, rid: str, pages: int) -> None:
    backend.submit(rid, pages)
    backend.poll(1)
    (decision,) = backend.collect()
    assert isinstance(decision, Admitted) and decision.rid == rid


def test_an_outage_is_logged_once_and_a_new_session_holds_the_engines_books_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sidecar = FlakySidecar()
    backend = SidecarBackend(sidecar, PAGES, blocking=False, unanswered_s=0.1)  # type: ignore[arg-type]
    backend.set_supply(PAGES - 1, 0)
    backend.open_session()
    admit(backend, "a", 12)
    admit(backend, "b", 6)
    backend.take("a", 4)
    backend.take("b", 6)
    backend.poll(0)
    backend.collect()
    assert running(sidecar.state) == [("a", 12, 4), ("b", 6, 6)]

    sidecar.down = True
    with caplog.at_level(logging.WARNING, logger="kvbank.sidecar"):
        backend.take("a", 1)
        backend.poll(0)
        backend.collect()  # the report failed: the outage starts
        assert backend.outage is not None and backend.outage.code == "UNAVAILABLE"
        assert not backend.settled()  # no pin on a ledger that is gone
        for _ in range(3):  # more steps, more failed tries: still one line
            backend.wire.next_open_at = 0.0
            backend.take("a", 1)
            backend.poll(0)
            backend.collect()
        backend.release("b")  # it finished during the outage

        sidecar.restart()
        sidecar.hold_opening = True
        backend.wire.next_open_at = 0.0
        backend.poll(0)  # the opening goes out with the books as they are now
        assert sidecar.held is not None
        assert [(r.rid, r.reserved, r.held) for r in sidecar.held[1].running] == [("a", 12, 8)]
        backend.take("a", 2)  # while it opens: kept, and sent after it
        sidecar.answer_opening()
        backend.collect()
        backend.poll(0)
        backend.collect()
    lost = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert [(r.levelname, sidecar.address in r.getMessage()) for r in lost] == [("ERROR", True)]
    assert sum("answers again" in r.getMessage() for r in caplog.records) == 1
    assert backend.outage is None and backend.settled()
    assert running(sidecar.state) == [("a", 12, 10)]  # restored once, and the take after it
    assert sidecar.state.status().pool.outstanding == backend.outstanding() == 2

    backend.release("a")
    backend.poll(0)
    backend.collect()
    pool = sidecar.state.status().pool
    assert (pool.reserved, pool.held, pool.outstanding, running(sidecar.state)) == (0, 0, 0, [])


def test_a_sidecar_that_refuses_the_engine_after_its_restart_is_an_outage_not_a_crash() -> None:
    sidecar = FlakySidecar()
    backend = SidecarBackend(sidecar, PAGES, blocking=False, unanswered_s=0.1)  # type: ignore[arg-type]
    backend.open_session()
    admit(backend, "a", 10)
    sidecar.down = True
    backend.poll(0)
    backend.take("a", 1)
    backend.poll(0)
    backend.collect()
    sidecar.restart()
    sidecar.state.pool_pages = PAGES * 2  # started for another pool
    backend.wire.next_open_at = 0.0
    backend.poll(0)
    backend.collect()
    assert backend.outage is not None and backend.outage.code == "FAILED_PRECONDITION"
    assert "pool of 64 pages" in backend.outage.describe()
