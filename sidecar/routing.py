"""The `Routing` service: what an endpoint picker reads of this pod and how it claims room here.

`Watch` streams the pod's routing figures when they change (every report that moves them, a
hold, a session opened or dropped) instead of letting pickers scrape them; a heartbeat resends
unchanged figures so a picker can tell a silent sidecar from a quiet pod. `Hold` and `Unhold`
keep the holds of sidecar/holds.py. Everything runs on the server's event loop, as the
admission service does.

The figures also feed two gauges on the pod's /metrics, for pickers configured by metrics alone
(llm-d's, docs/routing.md): `kvbank_headroom_pages` and `kvbank_admissible_worst_case_requests`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Gauge

from kvbank.ledger import InvalidPages
from kvbank.ledger.room import RoomCurve, room_curve
from kvbank.picker.rule import best_effort_queues, best_effort_room
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.holds import HoldBook, HoldKind
from kvbank.sidecar.state import AdmissionState
from kvbank.sidecar.wire_forms import shape_from_wire

DEFAULT_HEARTBEAT_S = 0.25
MIN_HEARTBEAT_S = 0.05
COALESCE_S = 0.005
MAX_WAITING_SENT = 256  # waiting worst cases sent one by one; the rest go summed into the last
MAX_ROOM_SENT = 256  # room curve pairs sent; a longer curve is cut, each run to its least room


class RoutingView:
    """The pod's routing figures, read from the admission state and the holds; `changed()`
    wakes every watcher."""

    def __init__(self, state: AdmissionState, worst_request_pages: int | None = None) -> None:
        self.state = state
        self.holds = HoldBook()
        self.worst_request_pages = worst_request_pages or 0
        self.version = 0
        self._cached: pb.RoutingFigures | None = None  # the figures of this version
        self._curve: RoomCurve | None = None  # the room curve they carry
        self._changed = asyncio.Event()
        state.on_change.append(self._state_changed)
        registry = state.metrics.registry
        Gauge(
            "kvbank_headroom_pages",
            "pages a request admitted now may take with every promise kept, less pickers' holds",
            registry=registry,
        ).set_function(lambda: float(self.figures().headroom_pages))
        Gauge(
            "kvbank_admissible_worst_case_requests",
            "worst-case requests of this pool the ledger would admit now, one after another "
            "(headroom over the pool's worst case; 0 without --pool)",
            registry=registry,
        ).set_function(lambda: float(self.admissible_worst_case()))

    def _state_changed(self, submitted: list[str]) -> None:
        """The books moved; the requests the engine submitted (their hold, else their id)
        take their holds' place."""
        for key in submitted:
            # The hold of a request the engine names by the picker's id; a request of several
            # prompts or sequences submits it as `<id>-<k>`.
            if not self.holds.release(key):
                base, dash, index = key.rpartition("-")
                if dash and index.isdigit():
                    self.holds.release(base)
        self.changed()

    def changed(self) -> None:
        self.version += 1
        self._cached = None
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def admissible_worst_case(self) -> int:
        worst = self.worst_request_pages
        return self.figures().headroom_pages // worst if worst > 0 else 0

    def figures(self) -> pb.RoutingFigures:
        """The figures of this version, computed once however many watchers read them (a
        hold past its ttl counts until the next expiry pass, at most 50 ms: conservative)."""
        if self._cached is None:
            self._cached = self._figures()
        return self._cached

    def _figures(self) -> pb.RoutingFigures:
        state = self.state
        ledger = state.ledger
        held = self.holds.figures()
        figures = pb.RoutingFigures(
            ready=state.session is not None and ledger is not None,
            holds=held.count,
            held_pages=held.pages,
            version=self.version,
            worst_request_pages=self.worst_request_pages,
        )
        if ledger is None:
            return figures
        waiting = [pages for _, pages in ledger.snapshot().waiting] + list(held.queued)
        if len(waiting) > MAX_WAITING_SENT:
            waiting[MAX_WAITING_SENT - 1 :] = [sum(waiting[MAX_WAITING_SENT - 1 :])]
        headroom = max(0, ledger.headroom - held.now_pages)
        figures.total_pages = ledger.total_pages
        figures.usable_pages = ledger.usable_pages
        figures.headroom_pages = headroom
        figures.waiting_pages.extend(waiting)
        be_held, be_backlog = state.best_effort
        backlog = be_backlog + held.best_effort_pages
        room = best_effort_room(headroom, sum(waiting), be_held, backlog)
        figures.best_effort_room_pages = max(0, room)
        figures.best_effort_backlog_pages = backlog
        curve = room_curve(ledger)  # built once per change of the running requests
        if curve is not None:
            curve = curve.less(held.now_pages).at_most(MAX_ROOM_SENT)
            figures.room_steps.extend(curve.steps)
            figures.room_pages.extend(curve.room)
            figures.pace_advance, figures.pace_lookahead = curve.pace.advance, curve.pace.lookahead
            figures.page_size = curve.page_size
        self._curve = curve
        return figures

    def hold(self, req: pb.HoldRequest) -> pb.HoldReply:
        ttl_s = self.holds.check(req.hold_id, req.pages, req.ttl_ms)
        self.expire()  # judged on the holds open now
        try:
            kind = HoldKind(req.kind)
        except ValueError as exc:
            raise InvalidPages(f"kind {req.kind} is not a hold kind", "kind") from exc
        ledger = self.state.ledger
        if ledger is not None and req.pages > ledger.total_pages:
            raise InvalidPages(
                f"pages {req.pages} is over the pod's {ledger.total_pages}: a hold is one "
                "request's worst case",
                "pages",
            )
        shape = None
        if req.HasField("shape") and ledger is not None:  # checked before anything changes
            shape = shape_from_wire(req.hold_id, req.shape, req.pages)
            shape.check(req.hold_id, req.pages, ledger.policy)
        if self.holds.release(req.hold_id):  # a retried hold is judged afresh, not on itself
            self.changed()
        now = self.figures()
        curve = self._curve
        granted = now.ready and (
            (
                kind is HoldKind.QUEUE
                and (
                    not req.HasField("max_ahead_pages")
                    or sum(now.waiting_pages) <= req.max_ahead_pages
                )
            )
            or (
                kind is HoldKind.NOW
                and not now.waiting_pages
                and (
                    req.pages <= now.headroom_pages
                    or (shape is not None and curve is not None and curve.fits(shape))
                )
            )
            or (
                kind is HoldKind.BEST_EFFORT
                and (
                    req.pages <= now.best_effort_room_pages  # it starts now, or it queues
                    or best_effort_queues(
                        sum(now.waiting_pages) + now.best_effort_backlog_pages,
                        req.pages,
                        now.usable_pages,
                    )
                )
            )
        )
        if not granted:
            return pb.HoldReply(granted=False, figures=now)
        self.holds.add(req.hold_id, req.pages, kind, ttl_s)
        self.changed()
        return pb.HoldReply(granted=True, figures=self.figures())

    def expire(self) -> None:
        if self.holds.expire():
            self.changed()


class RoutingService(pb_grpc.RoutingServicer):
    def __init__(self, view: RoutingView) -> None:
        self.view = view

    async def Watch(  # gRPC method names
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RoutingFigures]:
        if request.heartbeat_ms < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"heartbeat_ms must not be negative, got {request.heartbeat_ms}",
            )
        beat = request.heartbeat_ms / 1000 if request.heartbeat_ms else DEFAULT_HEARTBEAT_S
        beat = max(beat, MIN_HEARTBEAT_S)
        loop = asyncio.get_running_loop()
        last, sent_at = b"", 0.0
        while True:
            figures = self.view.figures()
            same = pb.RoutingFigures()
            same.CopyFrom(figures)
            same.version = 0
            key = same.SerializeToString(deterministic=True)
            now = loop.time()
            if key != last or now - sent_at >= beat:  # a report that moved nothing sends nothing
                yield figures
                last, sent_at = key, now
                # A busy pod changes with every hold; a watcher gets at most one message per
                # COALESCE_S (holds, not these figures, keep two picks off the same room).
                await asyncio.sleep(COALESCE_S)
            await self.view.wait_change(max(0.0, sent_at + beat - loop.time()))

    async def Hold(
        self, request: pb.HoldRequest, context: grpc.aio.ServicerContext
    ) -> pb.HoldReply:
        try:
            return self.view.hold(request)
        except InvalidPages as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, str(exc), (("kvbank-field", exc.field or ""),)
            )
            raise AssertionError("unreachable: abort raises") from exc

    async def Unhold(
        self, request: pb.UnholdRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnholdReply:
        released = self.view.holds.release(request.hold_id)
        if released:
            self.view.changed()
        return pb.UnholdReply(released=released)
