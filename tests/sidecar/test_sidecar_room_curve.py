"""The room curve over the wire: a peak-fit sidecar streams, beside its headroom, what a request
started now may hold at each step (kvbank/ledger/room.py), and grants a NOW hold whose worst case
is over the headroom when the request's shape fits that curve, as its ledger then admits it.
A hold's bad shape or pages get INVALID_ARGUMENT and change no hold."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from sidecar_harness import ThreadSidecar, make_config

from kvbank.ledger.room import RoomCurve
from kvbank.ledger.shape import Pace
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.client import SidecarClient

PACE = pb.LedgerPace(page_size=16, speculative_tokens=0, backfill_depth=8, max_advance=1)
NOW, QUEUE = pb.HoldRequest.NOW, pb.HoldRequest.QUEUE


def shape(base: int, worst: int, budget: int) -> pb.PeakShape:
    return pb.PeakShape(labels=["full"], base=[base], per_output=[1], worst=[worst],
                        output_budget=budget, prefill_chunks=1)  # fmt: skip


# The running request: a 2-page prompt that may grow to 60 pages over 928 steps.
LONG = shape(32, 960, 928)
# The newcomer: a 40-page prompt, 100 tokens of output: 47 pages at worst, reached at step 99,
# long before the running one reaches its own worst (step 927), when it is gone.
SHORT = shape(640, 740, 100)


@pytest.fixture
def pod() -> Iterator[tuple[SidecarClient, pb_grpc.RoutingStub, int]]:
    server = ThreadSidecar(make_config(pool_pages=101, policy="peak")).start_and_wait()
    try:
        with (
            SidecarClient(server.address, retry_budget_s=2.0) as client,
            grpc.insecure_channel(server.address) as channel,
        ):
            request = pb.OpenSessionRequest(
                engine_id="e", total_pages=101, supply=pb.Supply(free=100), policy="peak",
                pace=PACE,
            )  # fmt: skip
            session = client.open_session(request).session
            submit = pb.Event(submit=pb.Submit(rid="long", pages=60, shape=LONG))
            reply = client.report(
                pb.ReportRequest(session=session, report_seq=1, applied_seq=-1, events=[submit],
                                 admit=True, in_step=True, tries=[pb.Try(rid="long")])
            )  # fmt: skip
            assert [d.rid for d in reply.decisions] == ["long"]
            yield client, pb_grpc.RoutingStub(channel), session
    finally:
        server.shutdown()


def curve(figures: pb.RoutingFigures) -> RoomCurve:
    pace = Pace(figures.pace_advance, figures.pace_lookahead)
    return RoomCurve(tuple(figures.room_steps), tuple(figures.room_pages), pace, figures.page_size)


def test_a_peak_fit_pod_streams_its_room_curve(
    pod: tuple[SidecarClient, pb_grpc.RoutingStub, int],
) -> None:
    _, routing, _ = pod
    figures = next(routing.Watch(pb.WatchRequest(watcher_id="t", heartbeat_ms=5000)))
    room = curve(figures)
    assert (figures.page_size, figures.pace_advance, figures.pace_lookahead) == (16, 1, 0)
    # The least room is the headroom: the running request's worst, near its end.
    assert min(room.room) == figures.headroom_pages == 100 - 60
    assert room.room[0] > figures.headroom_pages  # now, it holds its 2 prompt pages only


def test_a_now_hold_over_the_headroom_is_granted_when_its_shape_fits_the_curve(
    pod: tuple[SidecarClient, pb_grpc.RoutingStub, int],
) -> None:
    client, routing, session = pod
    bare = routing.Hold(pb.HoldRequest(hold_id="h0", pages=47, ttl_ms=10_000, kind=NOW))
    assert not bare.granted and bare.figures.headroom_pages == 40  # 47 > 40: no shape, no
    held = routing.Hold(pb.HoldRequest(hold_id="h1", pages=47, ttl_ms=10_000, kind=NOW,
                                       shape=SHORT))  # fmt: skip
    assert held.granted
    # The hold comes off the headroom and every step of the curve.
    assert held.figures.headroom_pages == 0
    assert [r - 47 for r in bare.figures.room_pages] == list(held.figures.room_pages)
    # A second pick of the same room is refused: the curve has no room left for it.
    second = routing.Hold(pb.HoldRequest(hold_id="h2", pages=47, ttl_ms=10_000, kind=NOW,
                                         shape=SHORT))  # fmt: skip
    assert not second.granted
    # The ledger admits the request the hold was granted for, as the curve said.
    submit = pb.Event(submit=pb.Submit(rid="short", pages=47, shape=SHORT, hold="h1"))
    reply = client.report(
        pb.ReportRequest(session=session, report_seq=2, applied_seq=0, events=[submit],
                         admit=True, in_step=True, tries=[pb.Try(rid="short")])
    )  # fmt: skip
    assert [d.rid for d in reply.decisions] == ["short"]


def test_a_shape_that_does_not_fit_the_curve_is_refused(
    pod: tuple[SidecarClient, pb_grpc.RoutingStub, int],
) -> None:
    _, routing, _ = pod
    # 47 pages again, but grown to by step 720 and held to step 999: beside the running
    # request's 60 at its step 927, over the 100.
    slow = shape(32, 752, 1000)
    reply = routing.Hold(pb.HoldRequest(hold_id="h", pages=47, ttl_ms=10_000, kind=NOW,
                                        shape=slow))  # fmt: skip
    assert not reply.granted and reply.figures.holds == 0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        # A shape whose worst tokens fill 47 pages, sent with 46.
        (pb.HoldRequest(hold_id="h", pages=46, kind=NOW, shape=SHORT), "shape.worst"),
        (pb.HoldRequest(hold_id="h", pages=47, kind=NOW, shape=shape(640, 740, -1)), None),
        (pb.HoldRequest(hold_id="h", pages=47, kind=NOW, shape=shape(800, 740, 100)), None),
        # Granted before, two of these overflowed the figures' int64 sums: every watch and
        # hold of the pod failed with UNKNOWN until they expired.
        (pb.HoldRequest(hold_id="h", pages=1 << 62, kind=QUEUE), "pages"),
        (pb.HoldRequest(hold_id="h", pages=102, kind=NOW), "pages"),
    ],
)
def test_a_bad_hold_is_refused_and_changes_no_hold(
    pod: tuple[SidecarClient, pb_grpc.RoutingStub, int],
    request_: pb.HoldRequest,
    field: str | None,
) -> None:
    _, routing, _ = pod
    kept = routing.Hold(pb.HoldRequest(hold_id="h", pages=5, ttl_ms=10_000, kind=QUEUE))
    assert kept.granted
    with pytest.raises(grpc.RpcError) as err:
        routing.Hold(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    if field is not None:
        assert dict(err.value.trailing_metadata())["kvbank-field"] == field
    # The hold of the same id is still there, unchanged, and the figures still stream.
    figures = next(routing.Watch(pb.WatchRequest(watcher_id="t", heartbeat_ms=5000)))
    assert (figures.holds, list(figures.waiting_pages)) == (1, [5])
