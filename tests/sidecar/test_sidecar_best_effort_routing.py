"""kvbank's engine over a real sidecar tells pickers about its best-effort requests, which never
reach the ledger: the pages only they hold, what its best-effort queue waits for, and their
arrival, which releases the picker's hold on the pod's room for each."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from engine_run import scenario
from sidecar_harness import ThreadSidecar, make_config

from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.service_class import ServiceClass
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient


@pytest.fixture
def parts() -> Iterator[tuple[Engine, pb_grpc.RoutingStub]]:
    sc = scenario("shared-prefix", 8, 8)
    sidecar = ThreadSidecar(make_config(pool_pages=sc.pages)).start_and_wait()
    try:
        with (
            SidecarClient(sidecar.address) as client,
            grpc.insecure_channel(sidecar.address) as channel,
        ):
            backend = SidecarBackend(client, sc.pages, blocking=True)
            config = EngineConfig(sc.model, sc.pages, policy="peak+backfill", debug=True)
            engine = Engine(config, VirtualRunner(sc.cost, seed=1), backend)
            yield engine, pb_grpc.RoutingStub(channel)
    finally:
        sidecar.shutdown()


def figures(routing: pb_grpc.RoutingStub) -> pb.RoutingFigures:
    stream = routing.Watch(pb.WatchRequest(watcher_id="test"))
    try:
        return next(stream)  # the figures as they are now
    finally:
        stream.cancel()


def test_best_effort_arrivals_release_their_holds_and_their_pages_leave_the_room(
    parts: tuple[Engine, pb_grpc.RoutingStub],
) -> None:
    engine, routing = parts
    engine.step()  # the engine's session opens
    usable = figures(routing).usable_pages
    rids = [f"cmpl-be{i}" for i in range(3)]
    for rid in rids:  # a picker routed each here
        hold = pb.HoldRequest(hold_id=rid, pages=8, ttl_ms=60_000, kind=pb.HoldRequest.BEST_EFFORT)
        assert routing.Hold(hold).granted
    assert figures(routing).holds == 3
    for i, rid in enumerate(rids):
        prompt = list(range(100 * i, 100 * i + 100))
        engine.add_request(rid, prompt, 200, service_class=ServiceClass.BEST_EFFORT)
    engine.step()
    engine.step()  # the report of the step before carries the arrivals
    seen = figures(routing)
    assert seen.holds == 0, "the engine's arrivals did not release the picker's holds"
    held = engine.kv.reclaimable
    assert held > 0  # the three run, on pages only best-effort requests hold
    assert seen.best_effort_room_pages == min(usable, seen.headroom_pages) - held
    assert engine.sched.stats.preemptions == 0
