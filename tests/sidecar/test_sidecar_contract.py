"""The admission contract against a real gRPC server on loopback: decisions, retries, the
supply correction for decided-but-unapplied admissions, and the follower stream."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_harness import ThreadSidecar

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient, SidecarUnavailable


def submit(rid: str, pages: int) -> pb.Event:
    return pb.Event(submit=pb.Submit(rid=rid, pages=pages))


def supply(free: int, evictable: int) -> pb.Event:
    return pb.Event(supply=pb.Supply(free=free, evictable=evictable))


def outcome(d: pb.Decision) -> tuple[int, str, str]:
    return d.seq, d.rid, d.WhichOneof("outcome") or ""


def open_session(client: SidecarClient, **fields: object) -> int:
    request = pb.OpenSessionRequest(engine_id="engine-0", total_pages=101, **fields)  # type: ignore[arg-type]
    return client.open_session(request).session


def test_reports_are_answered_with_ordered_decisions(client: SidecarClient) -> None:
    session = open_session(client)
    reply = client.report(
        pb.ReportRequest(
            session=session,
            report_seq=1,
            applied_seq=-1,
            events=[submit("a", 40), submit("b", 50), submit("c", 20), submit("huge", 500)],
            admit=True,
        )
    )
    # "huge" is refused at ingest (seq 0); a and b fit 100 usable pages, c waits behind them.
    assert [outcome(d) for d in reply.decisions] == [
        (0, "huge", "refuse"),
        (1, "a", "admit"),
        (2, "b", "admit"),
    ]
    assert "raise the pool to at least 501 pages" in reply.decisions[0].refuse.message
    assert reply.waiting == 1
    assert (reply.pool.outstanding, reply.pool.free) == (90, 100)
    status = client.status()
    assert (status.running, status.waiting, status.next_seq, status.supply) == (2, 1, 3, 100)


def test_a_retried_report_gets_the_first_answer_and_applies_nothing_twice(
    client: SidecarClient,
) -> None:
    session = open_session(client)
    request = pb.ReportRequest(
        session=session, report_seq=1, applied_seq=-1, events=[submit("a", 10)], admit=True
    )
    first = client.report(request)
    again = client.report(request)
    assert again == first
    assert client.status().running == 1
    assert client.status().next_seq == 1


def test_unapplied_admissions_keep_their_idle_hit_off_the_reported_supply(
    client: SidecarClient,
) -> None:
    session = open_session(client, supply=pb.Supply(free=60, evictable=40))
    first = client.report(
        pb.ReportRequest(
            session=session,
            report_seq=1,
            applied_seq=-1,
            events=[submit("a", 30), submit("b", 75)],
            tries=[pb.Try(rid="a", hit=pb.Hit(pages=10, idle_pages=10))],
            admit=True,
        )
    )
    assert [outcome(d) for d in first.decisions] == [(0, "a", "admit")]
    # The ledger leased a's 10 idle pages: supply 100 - 10 = 90, outstanding 20.
    assert (first.pool.evictable, first.pool.outstanding) == (30, 20)
    # The engine reports before applying decision 0: its pool still counts those 10 pages as
    # evictable. Taken at face value, b (75 pages) would fit: 20 + 75 <= 100. It must not.
    second = client.report(
        pb.ReportRequest(
            session=session,
            report_seq=2,
            applied_seq=-1,
            events=[supply(60, 40)],
            tries=[pb.Try(rid="b", hit=pb.Hit())],
            admit=True,
        )
    )
    assert list(second.decisions) == []
    assert (second.pool.free, second.pool.evictable) == (60, 30)
    # Once applied, the engine's own count no longer has them: nothing to correct.
    third = client.report(
        pb.ReportRequest(session=session, report_seq=3, applied_seq=0, events=[supply(60, 30)])
    )
    assert (third.pool.free, third.pool.evictable) == (60, 30)


def test_admission_stops_after_room_heads(client: SidecarClient) -> None:
    session = open_session(client)
    request = pb.ReportRequest(
        session=session,
        report_seq=1,
        applied_seq=-1,
        events=[submit("a", 10), submit("b", 10), submit("c", 10)],
        admit=True,
        room=2,
    )
    reply = client.report(request)
    assert [d.rid for d in reply.decisions] == ["a", "b"]
    assert reply.waiting == 1
    again = pb.ReportRequest(session=session, report_seq=2, applied_seq=1, admit=True, room=0)
    assert list(client.report(again).decisions) == []


def test_followers_read_the_same_decisions_in_order_and_acks_trim_the_log(
    client: SidecarClient,
) -> None:
    session = open_session(client)
    client.report(
        pb.ReportRequest(
            session=session,
            report_seq=1,
            applied_seq=-1,
            events=[submit(f"r{i}", 10) for i in range(5)],
            admit=True,
        )
    )
    stream = client.follow("rank-1", 0)
    seen = [next(stream) for _ in range(5)]
    assert [(d.seq, d.rid) for d in seen] == [(i, f"r{i}") for i in range(5)]
    assert client.ack("rank-1", 2) == 3
    status = client.status_reply()
    assert (status.log_first_seq, status.log_length) == (3, 2)
    assert [(f.follower_id, f.acked_seq) for f in status.followers] == [("rank-1", 2)]
    # A follower that reconnects from its own sequence number resumes exactly there.
    resumed = client.follow("rank-1", 3)
    assert [next(resumed).rid for _ in range(2)] == ["r3", "r4"]


def test_a_reopened_session_sends_followers_back_to_reconnect_from_their_sequence_number(
    client: SidecarClient,
) -> None:
    session = open_session(client)
    client.report(
        pb.ReportRequest(
            session=session, report_seq=1, applied_seq=-1, events=[submit("a", 1)], admit=True
        )
    )
    stream = client.follow("rank-1", 0)
    assert next(stream).rid == "a"
    restore = pb.RunningRequest(rid="a", reserved=1, held=0)
    open_session(client, next_seq=1, running=[restore])  # the engine re-opens (same sidecar)
    with pytest.raises(SidecarUnavailable, match="reconnect from decision 1"):
        next(stream)
    resumed = client.follow("rank-1", 1)
    entry = next(resumed)
    assert (entry.seq, entry.rid, entry.WhichOneof("outcome")) == (1, "a", "restored")


def test_a_dead_engines_session_is_dropped_with_its_reservations(
    client: SidecarClient,
) -> None:
    session = open_session(client, lease_ms=300)
    client.report(
        pb.ReportRequest(
            session=session, report_seq=1, applied_seq=-1, events=[submit("a", 10)], admit=True
        )
    )
    assert client.status().reserved == 10
    deadline = time.monotonic() + 5
    while client.status().session != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    status = client.status()
    assert (status.session, status.reserved, status.running, status.supply) == (0, 0, 0, 100)
    fresh = open_session(client)
    assert fresh != session
    assert client.status().running == 0


def test_health_reports_serving(sidecar: ThreadSidecar) -> None:
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvbank.v1.Admission"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
