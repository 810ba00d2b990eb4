"""The picker's one gRPC client of the pods' sidecars: a `Watch` stream per pod keeps its
routing figures, and `Hold` claims room on the pod a request is routed to.

A pod is a candidate only while its stream is live: a stream that breaks, or sends nothing for
`loss_after_s` (its sidecar heartbeats every `heartbeat_s`), takes the pod out of the
candidates at once, with a log line and `kvbank_picker_pod_losses_total`; the watch then
reconnects with a capped backoff. Policies: a Hold gets `hold_timeout_s` and no retry (the
picker re-picks among the others); an error on it counts as losing the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvbank.ledger.room import RoomCurve
from kvbank.ledger.shape import Pace
from kvbank.picker.metrics import PickerMetrics
from kvbank.picker.prefix import PrefixRecord
from kvbank.picker.rule import PodFigures, RequestCount
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.client import routing_channel
from kvbank.sidecar.wire_forms import shape_to_wire

log = logging.getLogger("kvbank.picker")
PREFIX_BLOCKS_PER_POD = 31_250  # blocks remembered per pod, as llm-d's prefix scorer's default
MAX_ROOM_PAIRS = 1024  # a room curve longer than a sidecar sends (256) is not read


@dataclass(frozen=True)
class Pod:
    endpoint: str  # ip:port the gateway sends traffic to (the x-gateway-destination-endpoint)
    sidecar: str  # the pod's sidecar, host:port
    # The name its sidecar's certificate is checked against when `sidecar` is an IP the
    # certificate does not name (a discovered pod: its StatefulSet DNS name).
    tls_name: str | None = None


@dataclass(frozen=True)
class Link:
    """How the picker reaches sidecars: their token and CA, and its timings."""

    token: str | None = None
    ca_pem: bytes | None = None
    heartbeat_s: float = 0.25
    loss_after_s: float = 0.75
    hold_timeout_s: float = 0.25
    watcher_id: str = "kvbank-picker"


@dataclass
class Watched:
    pod: Pod
    # The prompt blocks the picker routed here (kvbank/picker/prefix.py): its affinity.
    prefixes: PrefixRecord = field(default_factory=lambda: PrefixRecord(PREFIX_BLOCKS_PER_POD))
    figures: pb.RoutingFigures | None = None
    live: bool = False
    heard: bool = False  # the first attempt has ended (figures or a failure)
    stub: pb_grpc.RoutingStub | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    # The room curve read off `figures`, kept with the message it was read from.
    _room: tuple[pb.RoutingFigures, RoomCurve | None] | None = field(default=None, repr=False)

    def room(self, f: pb.RoutingFigures) -> RoomCurve | None:
        """`room_from_wire(f)`, read once per figures message (every pick reads every pod)."""
        if self._room is None or self._room[0] is not f:
            self._room = (f, room_from_wire(f))
        return self._room[1]

    def pod_figures(self) -> PodFigures | None:
        f = self.figures
        if f is None or not self.live:
            return None
        return PodFigures(
            name=self.pod.endpoint,
            usable_pages=f.usable_pages,
            headroom_pages=f.headroom_pages,
            waiting_pages=tuple(f.waiting_pages),
            best_effort_room_pages=f.best_effort_room_pages,
            best_effort_backlog_pages=max(0, f.best_effort_backlog_pages),
            ready=f.ready,
            room=self.room(f),
            cached_blocks=self.prefixes.blocks(),
        )


def room_from_wire(f: pb.RoutingFigures) -> RoomCurve | None:
    """The pod's room curve; None when it sends none (a ledger that follows no progress) or
    one that does not hold together (the headroom test alone is then used)."""
    if not f.room_steps or len(f.room_steps) > MAX_ROOM_PAIRS:
        return None
    try:
        pace = Pace(f.pace_advance, f.pace_lookahead)
        return RoomCurve(tuple(f.room_steps), tuple(f.room_pages), pace, f.page_size)
    except ValueError:
        return None


class Sidecars:
    def __init__(self, pods: list[Pod], link: Link, metrics: PickerMetrics) -> None:
        self.link = link
        self.metrics = metrics
        self.watched = {pod.endpoint: Watched(pod) for pod in pods}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._started = False
        # False while a discovery has not listed the pods yet: the candidates are not known.
        self.listed = True
        self._changed = asyncio.Event()  # set, and replaced, whenever the candidates change

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        """Wait until a pod's figures change (or a pod joins or leaves), `timeout` s at most."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.link.token}"),) if self.link.token else ()

    def _start_one(self, watched: Watched) -> None:
        pod = watched.pod
        channel, watched.stub = routing_channel(pod.sidecar, self.link.ca_pem, pod.tls_name)
        self._channels[pod.endpoint] = channel
        watched.task = asyncio.create_task(self._watch(watched))

    def start(self) -> None:
        self._started = True
        for watched in self.watched.values():
            self._start_one(watched)

    async def _stop_one(self, watched: Watched) -> None:
        if watched.task is not None:
            watched.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watched.task
        channel = self._channels.pop(watched.pod.endpoint, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for watched in list(self.watched.values()):
            await self._stop_one(watched)

    async def add(self, pod: Pod) -> None:
        """A pod joins (discovery saw it Ready); a pod known under this endpoint with another
        sidecar is replaced."""
        known = self.watched.get(pod.endpoint)
        if known is not None and known.pod == pod:
            return
        if known is not None:
            await self.remove(pod.endpoint, "its sidecar changed")
        watched = self.watched[pod.endpoint] = Watched(pod)
        log.info("kvbank picker: pod %s joins (sidecar %s)", pod.endpoint, pod.sidecar)
        if self._started:
            self._start_one(watched)
        self._notify()

    async def remove(self, endpoint: str, why: str) -> None:
        """A pod leaves the candidates for good (unready, or gone): its watch stops."""
        watched = self.watched.pop(endpoint, None)
        if watched is None:
            return
        log.info("kvbank picker: pod %s leaves the candidates (%s)", endpoint, why)
        self.metrics.pod_live(endpoint, False)
        self._notify()
        await self._stop_one(watched)

    @property
    def synced(self) -> bool:
        """Every pod's first watch has answered or failed: the candidates are known."""
        return self.listed and all(w.heard for w in self.watched.values())

    def candidates(self) -> list[PodFigures]:
        return [f for w in self.watched.values() if (f := w.pod_figures()) is not None]

    def lose(self, watched: Watched, why: str) -> None:
        if watched.live:
            watched.live = False
            self.metrics.pod_lost(watched.pod.endpoint)
            log.warning(
                "kvbank picker: lost the sidecar of pod %s (%s): it leaves the candidates; %s",
                watched.pod.endpoint,
                watched.pod.sidecar,
                why,
            )
            self._notify()
        watched.heard = True

    async def _watch(self, watched: Watched) -> None:
        backoff = 0.05
        request = pb.WatchRequest(
            watcher_id=self.link.watcher_id, heartbeat_ms=int(self.link.heartbeat_s * 1000)
        )
        assert watched.stub is not None
        while True:
            call = watched.stub.Watch(request, metadata=self._metadata())
            try:
                while True:
                    figures = await asyncio.wait_for(call.read(), self.link.loss_after_s)
                    if figures is grpc.aio.EOF:
                        raise ConnectionError("the sidecar ended the stream")
                    known = watched.figures
                    # A Hold's reply may be newer than a stream message still on its way.
                    if known is None or not watched.live or figures.version >= known.version:
                        watched.figures = figures
                    if not watched.live:
                        log.info("kvbank picker: watching pod %s", watched.pod.endpoint)
                    watched.live = watched.heard = True
                    self.metrics.pod_live(watched.pod.endpoint, True)
                    self._notify()
                    backoff = 0.05
            except asyncio.CancelledError:
                call.cancel()
                raise
            except TimeoutError:
                call.cancel()
                self.lose(watched, f"no figures for {self.link.loss_after_s} s")
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                call.cancel()
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self.lose(watched, f"the stream broke: {detail}")
            self.metrics.pod_live(watched.pod.endpoint, False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def hold(
        self,
        endpoint: str,
        hold_id: str,
        pages: int,
        kind: pb.HoldRequest.Kind,
        ttl_s: float,
        max_ahead_pages: int | None = None,
        count: RequestCount | None = None,
    ) -> bool | None:
        """Claim `pages` on the pod: True granted, False refused (its room went to another
        pick; its figures are updated from the reply), None: the sidecar did not answer in
        time, or the pod left meanwhile (the pick goes elsewhere). `count`: the request, whose
        shape a NOW hold carries (for the pod's room curve) and whose prompt blocks a granted
        hold records for the pod (its prefix affinity)."""
        watched = self.watched.get(endpoint)
        if watched is None or watched.stub is None:
            return None
        shape = count.shape if count is not None and kind == pb.HoldRequest.NOW else None
        request = pb.HoldRequest(
            hold_id=hold_id,
            pages=pages,
            ttl_ms=int(ttl_s * 1000),
            kind=kind,
            max_ahead_pages=max_ahead_pages,
            shape=None if shape is None else shape_to_wire(shape),
        )
        started = time.perf_counter()
        try:
            reply = await watched.stub.Hold(
                request, timeout=self.link.hold_timeout_s, metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            # Only the watch stream decides a pod's liveness; a slow hold is only this pick's.
            self.metrics.hold_failures.labels(exc.code().name).inc()
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.lose(watched, f"a hold failed: {exc.details()}")
            return None
        finally:
            self.metrics.hold_latency.observe(time.perf_counter() - started)
        if reply.figures.version >= (watched.figures.version if watched.figures else 0):
            watched.figures = reply.figures
            self._notify()
        if reply.granted and count is not None:
            watched.prefixes.record(count.prefix_blocks)
        return bool(reply.granted)

    async def unhold(self, endpoint: str, hold_id: str) -> None:
        watched = self.watched.get(endpoint)
        if watched is None or watched.stub is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await watched.stub.Unhold(
                pb.UnholdRequest(hold_id=hold_id),
                timeout=self.link.hold_timeout_s,
                metadata=self._metadata(),
            )
