"""The real `kvbank sidecar` process against a caller holding its token and sending hostile
figures: shapes that wrap the timeline's int64 arithmetic, restores past the pool, negative
counts, ids and repeated fields of any length. Each gets INVALID_ARGUMENT naming its field, with
a message of bounded length, and the ledger's books do not move."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.auth import bearer
from kvbank.sidecar.client import SidecarClient, SidecarError

pytestmark = pytest.mark.timeout(120)

TOKEN = "the-group-token"
PACE = pb.LedgerPace(page_size=16, speculative_tokens=0, backfill_depth=8, max_advance=1)
INT64_MAX = (1 << 63) - 1
LONG = "r" * 100_000  # an id of 100 KB
MAX_ID = "i" * 256  # the longest id the wire takes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """One `kvbank sidecar --debug` with a token and no pool: each test opens its own session,
    of the policy it needs. Yields (port, metrics port)."""
    token = Path(tmp_path_factory.mktemp("token")) / "token"
    token.write_text(TOKEN + "\n")
    proc, port, metrics = spawn_sidecar(
        "--metrics-port", "0", "--debug", "--token-file", str(token)
    )
    assert metrics is not None
    try:
        yield port, metrics
    finally:
        stop_process(proc)


@pytest.fixture
def client(served: tuple[int, int]) -> Iterator[SidecarClient]:
    address = f"127.0.0.1:{served[0]}"
    with SidecarClient(address, token=TOKEN, retry_budget_s=2.0, follow_deadline_s=3) as c:
        yield c


def open_session(
    client: SidecarClient, policy: str = "banker", running: tuple[pb.RunningRequest, ...] = ()
) -> int:
    request = pb.OpenSessionRequest(
        engine_id="e", total_pages=1024, supply=pb.Supply(free=1023), policy=policy
    )
    request.running.extend(running)
    if policy != "banker":
        request.pace.CopyFrom(PACE)
    return client.open_session(request).session


def report(session: int, seq: int, *events: pb.Event, applied: int = -1) -> pb.ReportRequest:
    return pb.ReportRequest(
        session=session, report_seq=seq, applied_seq=applied, events=list(events), admit=True
    )


def submit(rid: str, pages: int) -> pb.Event:
    return pb.Event(submit=pb.Submit(rid=rid, pages=pages))


def shaped(
    rid: str, pages: int, base: int, per_output: int, worst: int, budget: int, chunks: int = 1
) -> pb.Event:
    event = submit(rid, pages)
    event.submit.shape.CopyFrom(
        pb.PeakShape(
            labels=["full"], base=[base], per_output=[per_output], worst=[worst],
            output_budget=budget, prefill_chunks=chunks,
        )
    )  # fmt: skip
    return event


def refused(client: SidecarClient, call: Callable[[], object]) -> SidecarError:
    """The error `call` ends in; the sidecar's books must read the same before and after."""
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        call()
    assert client.status_reply() == before
    assert len(caught.value.message) < 1000, caught.value.message[:200]
    return caught.value


# A running request `a` reserves 1000 of the 1023 usable pages; `b` asks for 100 more.
HONEST_A = (16, 1, 16000, 15984)  # base, per_output, worst (1000 pages of 16), output budget
HONEST_B = (16, 1, 1600, 1584)  # 100 pages

BAD_SHAPES: dict[str, tuple[tuple[int, int, int, int, int], str]] = {
    "worst tokens near the int64 limit": (
        (INT64_MAX - 7, 0, INT64_MAX - 7, 16, 1),
        "fill 576460752303423488 pages of 16 tokens, but it reserves 100",
    ),
    "worst tokens one past its pages": (
        (16, 1, 1601, 1585, 1),
        "fill 101 pages of 16 tokens, but it reserves 100",
    ),
    "a rate that wraps within the timeline": (
        (16, 1 << 61, 1600, 1584, 1),
        "grows by 2305843009213693952 tokens a step",
    ),
    "an output budget and prefill chunks past int64 together": (
        (16, 1, 1600, (1 << 62) + 1, (1 << 62) + 1),
        "output_budget 4611686018427387905",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_a_shape_that_disagrees_with_its_pages_is_refused_and_the_honest_one_waits(
    client: SidecarClient, case: str
) -> None:
    session = open_session(client, "peak")
    first = client.report(report(session, 1, shaped("a", 1000, *HONEST_A)))
    assert [d.rid for d in first.decisions] == ["a"]
    numbers, words = BAD_SHAPES[case]
    error = refused(client, lambda: client.report(report(session, 2, shaped("b", 100, *numbers))))
    assert (error.code, words in error.message) == ("INVALID_ARGUMENT", True), error.message
    # The same request with honest numbers waits: 1100 pages are not there.
    reply = client.report(report(session, 2, shaped("b", 100, *HONEST_B)))
    assert (list(reply.decisions), reply.waiting) == ([], 1)
    status = client.status()
    assert (status.reserved, status.usable_pages) == (1000, 1023)


def test_a_start_or_an_answer_with_prefill_chunks_past_int64_is_refused(
    client: SidecarClient,
) -> None:
    session = open_session(client, "peak")
    client.report(report(session, 1, shaped("a", 100, *HONEST_B)))  # admitted, deferred
    start = pb.Event(start=pb.Start(rid="a", prefill_chunks=INT64_MAX))
    error = refused(client, lambda: client.report(report(session, 2, start, applied=0)))
    assert error.code == "INVALID_ARGUMENT"
    assert f"prefill_chunks {INT64_MAX}" in error.message
    # A try with such a prefill bound is refused too, and the submit before it with it.
    ask = report(session, 2, shaped("b", 100, *HONEST_B), applied=0)
    ask.in_step = True
    ask.tries.add(rid="b", hit=pb.Hit(), prefill_chunks=INT64_MAX)
    error = refused(client, lambda: client.report(ask))
    assert error.code == "INVALID_ARGUMENT"
    assert f"prefill_chunks {INT64_MAX}" in error.message


def breaches(served: tuple[int, int]) -> str:
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{served[1]}/metrics", timeout=5)
    lines = scrape.read().decode().splitlines()
    return next(line for line in lines if line.startswith("kvbank_invariant_breaches_total "))


def test_restoring_more_than_the_pool_is_invalid_and_no_breach(
    client: SidecarClient, served: tuple[int, int]
) -> None:
    session = open_session(client)
    client.report(report(session, 1, submit("kept", 10)))
    before = breaches(served)
    running = (pb.RunningRequest(rid="x", reserved=600), pb.RunningRequest(rid="y", reserved=500))
    for _ in range(3):  # a retry counts nothing either
        error = refused(client, lambda: open_session(client, running=running))
        assert error.code == "INVALID_ARGUMENT"
        assert "may still take 1100 pages but the pool reports 1023" in error.message
    assert breaches(served) == before
    assert client.status().running == 1  # the session open before is still the session


def test_a_negative_evictable_count_is_refused(client: SidecarClient) -> None:
    session = open_session(client)
    negative = pb.Event(supply=pb.Supply(free=10, evictable=-5))
    error = refused(client, lambda: client.report(report(session, 1, negative)))
    assert error.code == "INVALID_ARGUMENT"
    assert "evictable must be a non-negative integer, got -5" in error.message


def progress(rid: str, labels: dict[str, int] | None = None) -> pb.Progress:
    return pb.Progress(rid=rid, produced=1, tokens_per_label=labels or {})


LONG_FIELDS: dict[str, tuple[Callable[[int], pb.ReportRequest], str]] = {
    "a submit": (lambda s: report(s, 1, submit(LONG, 3)), "events[0].submit.rid"),
    "a release": (
        lambda s: report(s, 1, pb.Event(release=pb.Release(rid=LONG))),
        "events[0].release.rid",
    ),
    "a cancel": (
        lambda s: report(s, 1, pb.Event(cancel=pb.Cancel(rid=LONG))),
        "events[0].cancel.rid",
    ),
    "a take": (
        lambda s: report(s, 1, pb.Event(take=pb.Take(rid=LONG, pages=1))),
        "events[0].take.rid",
    ),
    "a start": (lambda s: report(s, 1, pb.Event(start=pb.Start(rid=LONG))), "events[0].start.rid"),
    "an exclusive count": (
        lambda s: report(s, 1, pb.Event(exclusive=pb.Exclusive(rid=LONG))),
        "events[0].exclusive.rid",
    ),
    "a give-back": (
        lambda s: report(s, 1, pb.Event(give_back=pb.GiveBack(rid=LONG))),
        "events[0].give_back.rid",
    ),
    "a progress event": (
        lambda s: report(s, 1, pb.Event(advance=progress(LONG))),
        "events[0].advance.rid",
    ),
    "a progress entry": (
        lambda s: pb.ReportRequest(
            session=s, report_seq=1, applied_seq=-1, progress=[progress("a"), progress(LONG)]
        ),
        "progress[1].rid",
    ),
    "a try": (
        lambda s: pb.ReportRequest(
            session=s, report_seq=1, applied_seq=-1, tries=[pb.Try(rid=LONG)], admit=True
        ),
        "tries[0].rid",
    ),
    "a refusal message": (
        lambda s: report(s, 1, pb.Event(submit=pb.Submit(rid="a", pages=3, refusal=LONG))),
        "events[0].submit.refusal",
    ),
    "labels of a progress report": (
        lambda s: report(s, 1, pb.Event(advance=progress("a", {f"l{i}": 1 for i in range(5000)}))),
        "events[0].advance.tokens_per_label",
    ),
    "labels of a shape": (
        lambda s: report(
            s,
            1,
            pb.Event(
                submit=pb.Submit(
                    rid="a", pages=1, shape=pb.PeakShape(labels=[LONG], base=[1], worst=[1])
                )
            ),
        ),
        "events[0].submit.shape.labels",
    ),
    "a shape of many labels": (
        lambda s: report(
            s,
            1,
            pb.Event(
                submit=pb.Submit(
                    rid="a", pages=1, shape=pb.PeakShape(base=[0] * 5000, worst=[0] * 5000)
                )
            ),
        ),
        "events[0].submit.shape.base",
    ),
}


@pytest.mark.parametrize("case", sorted(LONG_FIELDS))
def test_an_id_or_repeated_field_past_its_bound_is_refused_in_a_report(
    client: SidecarClient, served: tuple[int, int], case: str
) -> None:
    session = open_session(client, "peak")
    make, field = LONG_FIELDS[case]
    error = refused(client, lambda: client.report(make(session)))
    assert error.code == "INVALID_ARGUMENT", error
    assert field in error.message
    # The field travels with the status, for a caller that acts on it.
    channel = grpc.insecure_channel(f"127.0.0.1:{served[0]}")
    try:
        with pytest.raises(grpc.RpcError) as raw:
            pb_grpc.AdmissionStub(channel).Report(make(session), metadata=bearer(TOKEN), timeout=5)
        trailing = dict(raw.value.trailing_metadata() or ())  # type: ignore[attr-defined]
    finally:
        channel.close()
    assert trailing["kvbank-field"] == field


def test_an_id_past_its_bound_is_refused_in_a_session_a_follow_and_an_ack(
    client: SidecarClient,
) -> None:
    open_session(client)
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: client.open_session(pb.OpenSessionRequest(engine_id=LONG, total_pages=64)), ""),
        (lambda: open_session(client, running=(pb.RunningRequest(rid=LONG),)), "running[0].rid"),
        (lambda: client.ack(LONG, 0), "follower_id"),
        (lambda: next(client.follow(LONG, 0)), "follower_id"),
    ]
    for call, field in calls:
        error = refused(client, call)
        assert error.code == "INVALID_ARGUMENT", error
        assert "at most 256 bytes" in error.message and field in error.message


def test_an_id_at_the_bound_is_taken_and_an_unknown_one_quoted_short(
    client: SidecarClient,
) -> None:
    session = open_session(client)
    client.report(report(session, 1, submit(MAX_ID, 2)))
    assert [r.rid for r in client.status_reply().running] == [MAX_ID]
    unknown = pb.Event(release=pb.Release(rid="u" * 256))
    error = refused(client, lambda: client.report(report(session, 2, unknown, applied=0)))
    assert error.code == "NOT_FOUND"
    assert "is not running" in error.message and len(error.message) < 200


def test_a_restored_request_s_exclusive_count_must_be_among_its_held_pages(
    client: SidecarClient,
) -> None:
    # A restored request is not followed step by step, but its exclusive count is kept (and
    # returned to the supply when it is released): it must be a count of pages it holds.
    restored = (pb.RunningRequest(rid="r", reserved=10, held=5),)
    session = open_session(client, "peak", running=restored)
    for exclusive, words in ((-3, "exclusive -3"), (99, "reports 99 exclusive pages of the 5")):
        step = pb.Progress(rid="r", produced=1, exclusive=exclusive)
        bad = pb.ReportRequest(session=session, report_seq=1, applied_seq=0, progress=[step])
        error = refused(client, lambda: client.report(bad))  # noqa: B023
        assert (error.code, words in error.message) == ("INVALID_ARGUMENT", True), error.message


def test_a_session_numbered_near_the_int64_limit_is_refused(client: SidecarClient) -> None:
    open_session(client)
    near = pb.OpenSessionRequest(engine_id="e", total_pages=1024, next_seq=INT64_MAX)
    near.running.add(rid="r", reserved=1)
    error = refused(client, lambda: client.open_session(near))
    assert error.code == "INVALID_ARGUMENT"
    assert f"next_seq {INT64_MAX} is past" in error.message


def test_a_pool_or_pace_past_a_modelpool_s_is_refused(client: SidecarClient) -> None:
    open_session(client)
    for request, words in (
        (pb.OpenSessionRequest(total_pages=1 << 40), "total_pages 1099511627776"),
        (
            pb.OpenSessionRequest(
                total_pages=1024, policy="peak", pace=pb.LedgerPace(page_size=1 << 30)
            ),
            "pace page_size 1073741824",
        ),
    ):
        error = refused(client, lambda: client.open_session(request))  # noqa: B023
        assert (error.code, words in error.message) == ("INVALID_ARGUMENT", True), error.message


def test_a_full_queue_of_the_longest_ids_reads_in_kvbank_status(
    client: SidecarClient, served: tuple[int, int], tmp_path: Path
) -> None:
    """What the id bound is for: the default --max-waiting of 256-byte ids (and one that would
    rewrite the operator's terminal) fits the status reply every reader takes."""
    session = open_session(client)
    ids = [f"{i:05d}".ljust(256, "q") for i in range(8191)] + ["\x1b[2Jfake row\n".ljust(256)]
    for seq, first in enumerate(range(0, len(ids), 2048), start=1):
        events = [submit(rid, 500) for rid in ids[first : first + 2048]]
        client.report(
            pb.ReportRequest(session=session, report_seq=seq, applied_seq=-1, events=events)
        )
    token = tmp_path / "token"
    token.write_text(TOKEN)
    address = f"127.0.0.1:{served[0]}"
    shown = kvbank_status(address, "--token-file", str(token), "--limit", "9000")
    assert shown.returncode == 0, shown.stderr
    assert "queue     8192 waiting" in shown.stdout
    assert "\x1b" not in shown.stdout and "'\\x1b[2Jfake row\\n" in shown.stdout


def kvbank_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
