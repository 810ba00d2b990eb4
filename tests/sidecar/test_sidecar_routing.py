"""The sidecar's Routing service against a real server on loopback: the figures a picker
watches, holds that take room off them until the engine's submit carries them back or they
expire, and the two gauges llm-d's picker reads."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from sidecar_harness import ThreadSidecar, make_config

from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.client import SidecarClient, SidecarError

NOW, QUEUE, BEST_EFFORT = pb.HoldRequest.NOW, pb.HoldRequest.QUEUE, pb.HoldRequest.BEST_EFFORT


@pytest.fixture
def routing(sidecar: ThreadSidecar) -> Iterator[pb_grpc.RoutingStub]:
    with grpc.insecure_channel(sidecar.address) as channel:
        yield pb_grpc.RoutingStub(channel)


def open_session(client: SidecarClient) -> int:
    request = pb.OpenSessionRequest(
        engine_id="engine-0", total_pages=101, supply=pb.Supply(free=100, evictable=0)
    )
    return client.open_session(request).session


def report(client: SidecarClient, session: int, seq: int, *events: pb.Event) -> pb.ReportReply:
    return client.report(
        pb.ReportRequest(session=session, report_seq=seq, applied_seq=-1, events=events)
    )


def test_figures_stream_on_change_and_say_when_no_engine_serves(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    stream = routing.Watch(pb.WatchRequest(watcher_id="t", heartbeat_ms=5000))
    first = next(stream)
    assert not first.ready  # a pool but no engine session: nothing serves requests here
    session = open_session(client)
    opened = next(stream)
    assert (opened.ready, opened.usable_pages, opened.headroom_pages) == (True, 100, 100)
    report(client, session, 1, pb.Event(submit=pb.Submit(rid="a", pages=30)))
    waiting = next(stream)
    assert list(waiting.waiting_pages) == [30] and waiting.version > opened.version
    stream.cancel()


def test_a_hold_takes_room_until_the_engine_submits_its_request(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    session = open_session(client)
    held = routing.Hold(pb.HoldRequest(hold_id="h1", pages=60, ttl_ms=10_000, kind=NOW))
    assert held.granted and held.figures.headroom_pages == 40
    # A second picker's pick of the same room is refused: 60 more do not fit the 40 left.
    second = routing.Hold(pb.HoldRequest(hold_id="h2", pages=60, ttl_ms=10_000, kind=NOW))
    assert not second.granted and second.figures.headroom_pages == 40
    queued = routing.Hold(pb.HoldRequest(hold_id="h3", pages=60, ttl_ms=10_000, kind=QUEUE))
    assert queued.granted and list(queued.figures.waiting_pages) == [60]
    be = routing.Hold(pb.HoldRequest(hold_id="h4", pages=41, ttl_ms=10_000, kind=BEST_EFFORT))
    # The queued 60 take what strict promises leave, and they and it would not fit the pool.
    assert not be.granted and be.figures.best_effort_room_pages == 0
    # The engine's submit carries h1 back: the ledger holds the request's books now.
    report(client, session, 1, pb.Event(submit=pb.Submit(rid="r1", pages=60, hold="h1")))
    reply = routing.Unhold(pb.UnholdRequest(hold_id="h1"))
    assert not reply.released  # gone already
    assert routing.Unhold(pb.UnholdRequest(hold_id="h3")).released
    figures = routing.Hold(pb.HoldRequest(hold_id="h5", pages=0, kind=QUEUE)).figures
    assert list(figures.waiting_pages) == [60, 0]  # r1 waits in the ledger (no admission asked)


def test_a_hold_expires_after_its_ttl(client: SidecarClient, routing: pb_grpc.RoutingStub) -> None:
    open_session(client)
    assert routing.Hold(pb.HoldRequest(hold_id="h", pages=100, ttl_ms=200, kind=NOW)).granted
    stream = routing.Watch(pb.WatchRequest(heartbeat_ms=50))
    deadline = time.monotonic() + 2
    while next(stream).headroom_pages != 100:
        assert time.monotonic() < deadline, "the hold outlived its ttl by over 1.8 s"
    stream.cancel()


def test_bad_holds_are_refused_naming_the_field(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    open_session(client)
    for request, field in [
        (pb.HoldRequest(hold_id="", pages=1), "hold_id"),
        (pb.HoldRequest(hold_id="x" * 600, pages=1), "hold_id"),
        (pb.HoldRequest(hold_id="h", pages=-1), "pages"),
        (pb.HoldRequest(hold_id="h", pages=1, ttl_ms=-5), "ttl_ms"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            routing.Hold(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(err.value.trailing_metadata())["kvbank-field"] == field
    figures = routing.Hold(pb.HoldRequest(hold_id="ok", pages=0, kind=QUEUE)).figures
    assert figures.holds == 1  # none of the bad ones was kept


def test_the_pod_metrics_carry_headroom_and_admissible_worst_cases() -> None:
    with socket.socket() as probe:  # a free port for the metrics server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sidecar = ThreadSidecar(
        replace(make_config(pool_pages=101, worst_request_pages=30), metrics_port=port)
    ).start_and_wait()
    try:
        with SidecarClient(sidecar.address) as client:
            open_session(client)
        with grpc.insecure_channel(sidecar.address) as channel:
            hold = pb.HoldRequest(hold_id="h", pages=25, ttl_ms=10_000, kind=NOW)
            pb_grpc.RoutingStub(channel).Hold(hold)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        sidecar.shutdown()
    lines = text.decode().splitlines()
    assert "kvbank_headroom_pages 75.0" in lines
    assert "kvbank_admissible_worst_case_requests 2.0" in lines  # 75 // 30


def test_a_submit_named_by_the_hold_releases_it(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    session = open_session(client)
    for hold_id in ("cmpl-a", "cmpl-b"):
        routing.Hold(pb.HoldRequest(hold_id=hold_id, pages=10, ttl_ms=10_000, kind=NOW))
    # The engine names a request by the picker's id; one of several prompts as `<id>-<k>`.
    report(client, session, 1, pb.Event(submit=pb.Submit(rid="cmpl-a", pages=10)))
    report(client, session, 2, pb.Event(submit=pb.Submit(rid="cmpl-b-0", pages=10)))
    figures = routing.Hold(pb.HoldRequest(hold_id="probe", pages=0, kind=QUEUE)).figures
    assert (figures.holds, list(figures.waiting_pages)) == (1, [10, 10, 0])


def test_a_queued_hold_goes_elsewhere_when_the_queue_grew_since_the_pick(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    open_session(client)
    first = pb.HoldRequest(hold_id="q1", pages=66, ttl_ms=10_000, kind=QUEUE, max_ahead_pages=0)
    assert routing.Hold(first).granted
    second = pb.HoldRequest(hold_id="q2", pages=66, ttl_ms=10_000, kind=QUEUE, max_ahead_pages=0)
    refused = routing.Hold(second)
    assert not refused.granted and list(refused.figures.waiting_pages) == [66]
    unbounded = pb.HoldRequest(hold_id="q2", pages=66, ttl_ms=10_000, kind=QUEUE)
    assert routing.Hold(unbounded).granted  # a picker's last try queues wherever it chose


def test_watch_and_hold_need_the_token_where_the_sidecar_has_one() -> None:
    sidecar = ThreadSidecar(make_config(pool_pages=101, token="s3cret")).start_and_wait()
    try:
        with grpc.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.RoutingStub(channel)
            for call in (
                lambda: next(stub.Watch(pb.WatchRequest())),
                lambda: stub.Hold(pb.HoldRequest(hold_id="h", pages=1)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            token = (("authorization", "Bearer s3cret"),)
            stream = stub.Watch(pb.WatchRequest(), metadata=token)
            assert next(stream).usable_pages == 100
            stream.cancel()
    finally:
        sidecar.shutdown()


def test_best_effort_picks_follow_the_engines_best_effort_figures(
    client: SidecarClient, routing: pb_grpc.RoutingStub
) -> None:
    """The ledger's supply counts the pages only best-effort requests hold (strict admission
    takes them back): a best-effort request cannot take them, nor what the engine's
    best-effort queue waits for. With no room it may still queue while the backlog fits the
    pool, and the engine's report of its arrival releases the picker's hold."""
    session = open_session(client)
    supply = pb.Event(supply=pb.Supply(free=70, evictable=30))
    figures = pb.BestEffort(held=30, backlog=20)
    report(client, session, 1, supply, pb.Event(best_effort=figures))
    probe = pb.HoldRequest(hold_id="probe", pages=0, kind=QUEUE)
    seen = routing.Hold(probe).figures
    assert (seen.headroom_pages, seen.best_effort_room_pages) == (100, 50)
    assert seen.best_effort_backlog_pages == 20
    routing.Unhold(pb.UnholdRequest(hold_id="probe"))

    def hold(hold_id: str, pages: int) -> pb.HoldReply:
        return routing.Hold(
            pb.HoldRequest(hold_id=hold_id, pages=pages, ttl_ms=10_000, kind=BEST_EFFORT)
        )

    assert hold("cmpl-1", 50).granted  # it starts now: the room is 50
    queued = hold("cmpl-2", 20)  # no room; 20 waiting, the 50 held and it: 90 of 100
    assert queued.granted and queued.figures.best_effort_backlog_pages == 90
    full = hold("cmpl-3", 20)  # 110: a pool deep, the pod is full
    assert not full.granted and full.figures.best_effort_room_pages == 0
    # A bad figure changes nothing: the report fails whole.
    bad = pb.Event(best_effort=pb.BestEffort(held=-1, arrived=["cmpl-1"]))
    with pytest.raises(SidecarError):
        report(client, session, 2, bad)
    # The engine queued both requests: their holds go, its own backlog counts them now.
    arrived = pb.BestEffort(held=30, backlog=90, arrived=["cmpl-1", "cmpl-2"])
    report(client, session, 2, pb.Event(best_effort=arrived))
    seen = routing.Hold(probe).figures
    assert (seen.holds, seen.best_effort_backlog_pages, seen.best_effort_room_pages) == (1, 90, 0)
    # A new engine session starts with no best-effort figures until the engine sends some.
    open_session(client)
    seen = routing.Hold(pb.HoldRequest(hold_id="probe", pages=0, kind=QUEUE)).figures
    assert (seen.best_effort_backlog_pages, seen.best_effort_room_pages) == (0, 100)
