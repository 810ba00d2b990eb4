"""Bad input gets the right gRPC status with a message, and the ledger does not move."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sidecar_harness import ThreadSidecar, make_config

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SessionLost, SidecarClient, SidecarError


def submit(rid: str, pages: int) -> pb.Event:
    return pb.Event(submit=pb.Submit(rid=rid, pages=pages))


@pytest.fixture
def opened(client: SidecarClient) -> Iterator[tuple[SidecarClient, int]]:
    """A session with a running request `a` (reserved 30, held 5) and a waiting `w`."""
    session = client.open_session(
        pb.OpenSessionRequest(engine_id="e", total_pages=101, supply=pb.Supply(free=100))
    ).session
    client.report(
        pb.ReportRequest(
            session=session,
            report_seq=1,
            applied_seq=-1,
            events=[submit("a", 30), submit("w", 90)],
            admit=True,
        )
    )
    client.report(
        pb.ReportRequest(
            session=session,
            report_seq=2,
            applied_seq=0,
            events=[pb.Event(take=pb.Take(rid="a", pages=5))],
        )
    )
    yield client, session


def report(session: int, *events: pb.Event, seq: int = 3, applied: int = 0) -> pb.ReportRequest:
    return pb.ReportRequest(
        session=session, report_seq=seq, applied_seq=applied, events=list(events), admit=True
    )


def best_effort(held: int = 0, backlog: int = 0, *arrived: str) -> pb.Event:
    return pb.Event(best_effort=pb.BestEffort(held=held, backlog=backlog, arrived=arrived))


BAD_REPORTS: dict[str, tuple[Callable[[int], pb.ReportRequest], str, str]] = {
    # The engine's best-effort figures are checked with the report's other events: a bad one
    # fails the whole report (the submit before it too), and the pickers' figures keep theirs.
    "negative best-effort pages held": (
        lambda s: report(s, submit("x", 3), best_effort(held=-1)),
        "INVALID_ARGUMENT",
        "held must be a non-negative integer, got -1",
    ),
    "best-effort pages held over the pool": (
        lambda s: report(s, best_effort(held=10**12)),
        "INVALID_ARGUMENT",
        "held=1000000000000 exceeds the pool's 101 pages",
    ),
    "negative best-effort backlog": (
        lambda s: report(s, best_effort(backlog=-(2**62))),
        "INVALID_ARGUMENT",
        "backlog must be a non-negative integer",
    ),
    "a long best-effort arrival id": (
        lambda s: report(s, best_effort(0, 0, "ok", "x" * 300)),
        "INVALID_ARGUMENT",
        "events[0].best_effort.arrived[1] is 300 bytes",
    ),
    "negative pages": (
        lambda s: report(s, submit("x", -3)),
        "INVALID_ARGUMENT",
        "pages must be a non-negative integer, got -3",
    ),
    "empty request id": (lambda s: report(s, submit("", 3)), "INVALID_ARGUMENT", "non-empty"),
    "take beyond the reservation": (
        lambda s: report(s, pb.Event(take=pb.Take(rid="a", pages=26))),
        "INVALID_ARGUMENT",
        "may take at most 25 more",
    ),
    "supply over the pool": (
        lambda s: report(s, pb.Event(supply=pb.Supply(free=90, evictable=20))),
        "INVALID_ARGUMENT",
        "exceeds the pool's 100 usable pages",
    ),
    "bad hit": (
        lambda s: pb.ReportRequest(
            session=s,
            report_seq=3,
            applied_seq=0,
            tries=[pb.Try(rid="w", hit=pb.Hit(pages=2, idle_pages=5))],
            admit=True,
        ),
        "INVALID_ARGUMENT",
        "idle_pages 5 <= pages 2",
    ),
    "unknown request": (
        lambda s: report(s, pb.Event(release=pb.Release(rid="ghost"))),
        "NOT_FOUND",
        "'ghost' is not running",
    ),
    "cancel of a running request": (
        lambda s: report(s, pb.Event(cancel=pb.Cancel(rid="a"))),
        "NOT_FOUND",
        "'a' is not waiting",
    ),
    "progress of a request that is not running": (
        lambda s: pb.ReportRequest(
            session=s, report_seq=3, applied_seq=0, progress=[pb.Progress(rid="w", produced=1)]
        ),
        "NOT_FOUND",
        "'w' is not running",
    ),
    "duplicate request": (lambda s: report(s, submit("w", 3)), "ALREADY_EXISTS", "'w'"),
    "give back more than held": (
        lambda s: report(s, pb.Event(give_back=pb.GiveBack(rid="a", held=6, reserved=10))),
        "INVALID_ARGUMENT",
        "holds 5 of its 30 reserved pages; it cannot give back 10 reserved pages of which 6",
    ),
    "give back negative pages": (
        lambda s: report(s, pb.Event(give_back=pb.GiveBack(rid="a", held=-1, reserved=2))),
        "INVALID_ARGUMENT",
        "held must be a non-negative integer, got -1",
    ),
    "give back of a request that is not running": (
        lambda s: report(s, pb.Event(give_back=pb.GiveBack(rid="w", held=0, reserved=1))),
        "NOT_FOUND",
        "'w' is not running",
    ),
    # Good events first, then a bad one: nothing of the batch may stick.
    "a bad event after good ones": (
        lambda s: report(
            s, submit("new", 3), pb.Event(release=pb.Release(rid="a")), submit("w", 1)
        ),
        "ALREADY_EXISTS",
        "'w' is already known",
    ),
    "a skipped report number": (
        lambda s: report(s, submit("x", 1), seq=5),
        "FAILED_PRECONDITION",
        "report 5 arrived after report 2",
    ),
    "the last report number with other content": (
        lambda s: report(s, submit("x", 1), seq=2),
        "FAILED_PRECONDITION",
        "report 2 was already applied with other content",
    ),
    "an old report number": (
        lambda s: report(s, submit("x", 1), seq=1),
        "FAILED_PRECONDITION",
        "report 1 arrived after report 2",
    ),
    "applied beyond the last decision": (
        lambda s: report(s, submit("x", 1), applied=7),
        "FAILED_PRECONDITION",
        "applied_seq 7 must lie between the last applied 0 and the last decision made 0",
    ),
    "applied going backwards": (
        lambda s: report(s, submit("x", 1), applied=-1),
        "FAILED_PRECONDITION",
        "applied_seq -1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_a_bad_report_fails_and_leaves_the_ledger_unchanged(
    opened: tuple[SidecarClient, int], case: str
) -> None:
    client, session = opened
    make, code, words = BAD_REPORTS[case]
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.report(make(session))
    assert caught.value.code == code
    assert words in caught.value.message
    assert client.status_reply() == before


def test_a_report_for_a_session_this_sidecar_does_not_hold_is_aborted(
    opened: tuple[SidecarClient, int],
) -> None:
    client, session = opened
    before = client.status_reply()
    with pytest.raises(SessionLost, match="open a new session"):
        client.report(report(session + 1, submit("x", 1)))
    assert client.status_reply() == before


def test_a_session_for_another_pool_is_refused(opened: tuple[SidecarClient, int]) -> None:
    client, _ = opened
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.open_session(pb.OpenSessionRequest(engine_id="e", total_pages=64))
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "pool of 64 pages but this sidecar was started for 101" in caught.value.message
    restore = pb.RunningRequest(rid="r", reserved=5, held=9)
    with pytest.raises(SidecarError) as caught:
        client.open_session(pb.OpenSessionRequest(total_pages=101, running=[restore]))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "holds 9 pages but reserved 5" in caught.value.message
    assert client.status_reply() == before


def test_a_session_naming_no_ledger_policy_is_an_invalid_argument(
    opened: tuple[SidecarClient, int],
) -> None:
    client, _ = opened
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.open_session(pb.OpenSessionRequest(total_pages=101, policy="peak+yolo"))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "choose one of banker, peak, peak+backfill, banker+backfill" in caught.value.message
    assert client.status_reply() == before


def test_an_oversized_message_is_resource_exhausted(sidecar: ThreadSidecar) -> None:
    big = SidecarClient(sidecar.address, max_message_bytes=8 << 20, retry_budget_s=1)
    session = big.open_session(pb.OpenSessionRequest(engine_id="e", total_pages=101)).session
    before = big.status_reply()
    with pytest.raises(SidecarError) as caught:
        big.report(report(session, submit("x" * (2 << 20), 1), seq=1, applied=-1))
    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert big.status_reply() == before
    big.close()


def test_followers_out_of_range_are_refused(opened: tuple[SidecarClient, int]) -> None:
    client, _ = opened
    with pytest.raises(SidecarError) as caught:
        next(client.follow("rank-1", 9))
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "cannot start at 9" in caught.value.message
    with pytest.raises(SidecarError) as caught:
        client.ack("rank-1", 9)
    assert caught.value.code == "FAILED_PRECONDITION"
    with pytest.raises(SidecarError) as caught:
        client.ack("", 0)
    assert caught.value.code == "INVALID_ARGUMENT"


def test_a_wrong_token_is_unauthenticated(tmp_path: Path) -> None:
    server = ThreadSidecar(make_config(pool_pages=101, token="s3cret")).start_and_wait()
    try:
        for token in (None, "wrong"):
            with SidecarClient(server.address, token=token, retry_budget_s=1) as c:
                with pytest.raises(SidecarError) as caught:
                    c.status()
                assert caught.value.code == "UNAUTHENTICATED"
                assert "--token-file" in caught.value.message
                with pytest.raises(SidecarError) as caught:
                    next(c.follow("rank-1", 0))
                assert caught.value.code == "UNAUTHENTICATED"
        with SidecarClient(server.address, token="s3cret") as c:
            assert c.status().usable_pages == 100
    finally:
        server.shutdown()
