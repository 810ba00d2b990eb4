"""The peak-fit ledger over the wire: the session's policy and pace, shapes, progress, sole
pages and the tries a report carries, answered in order; every bad field gets its status and
leaves the ledger as it was."""

from __future__ import annotations

import argparse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sidecar_harness import ROOT, ThreadSidecar, make_config, spawn_sidecar, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar import server
from kvbank.sidecar.client import SidecarClient, SidecarError

PACE = pb.LedgerPace(page_size=16, speculative_tokens=0, backfill_depth=8, max_advance=1)


def shape(base: int = 32, worst: int = 160, budget: int = 128) -> pb.PeakShape:
    return pb.PeakShape(
        labels=["full"], base=[base], per_output=[1], worst=[worst], output_budget=budget,
        prefill_chunks=1,
    )  # fmt: skip


def submit(rid: str, pages: int, wire: pb.PeakShape | None = None) -> pb.Event:
    event = pb.Event(submit=pb.Submit(rid=rid, pages=pages))
    if wire is not None:
        event.submit.shape.CopyFrom(wire)
    return event


@pytest.fixture
def peak_client() -> Iterator[SidecarClient]:
    server = ThreadSidecar(make_config(pool_pages=101, policy="peak")).start_and_wait()
    try:
        with SidecarClient(server.address, retry_budget_s=2.0) as c:
            yield c
    finally:
        server.shutdown()


def open_peak(client: SidecarClient) -> int:
    request = pb.OpenSessionRequest(
        engine_id="e", total_pages=101, supply=pb.Supply(free=100), policy="peak", pace=PACE
    )
    return client.open_session(request).session


def ask(
    session: int, seq: int, applied: int, question: pb.Try, *events: pb.Event
) -> pb.ReportRequest:
    """An engine asking in step: the events, then one try, answered in the reply."""
    return pb.ReportRequest(
        session=session, report_seq=seq, applied_seq=applied, events=list(events), admit=True,
        in_step=True, tries=[question],
    )  # fmt: skip


def test_each_try_is_answered_in_order_on_the_ledger_the_events_left(
    peak_client: SidecarClient,
) -> None:
    session = open_peak(peak_client)
    supply = pb.Event(supply=pb.Supply(free=98, evictable=2))  # `a`'s two cached pages
    events = [supply, submit("a", 10, shape()), submit("b", 10)]
    hit = pb.Hit(pages=2, idle_pages=2, sole_pages=0)
    reply = peak_client.report(ask(session, 1, -1, pb.Try(rid="a", hit=hit), *events))
    assert [(d.rid, d.seq, d.admit.reserved, d.admit.hit.pages) for d in reply.decisions] == [
        ("a", 0, 10, 2)
    ]
    take = pb.Event(take=pb.Take(rid="a", pages=2))
    reply = peak_client.report(ask(session, 2, 0, pb.Try(rid="b", no_room=True), take))
    assert (list(reply.decisions), reply.waiting, reply.backfilling) == ([], 1, False)
    status = peak_client.status_reply()
    assert [(r.rid, r.reserved, r.held) for r in status.running] == [("a", 10, 4)]
    assert (status.pool.free, status.pool.evictable, status.pool.outstanding) == (96, 0, 6)
    progress = pb.Progress(rid="a", tokens_per_label={"full": 33}, produced=1, chunks_left=0)
    events = [pb.Event(advance=progress), pb.Event(end_step=pb.EndStep())]
    reply = peak_client.report(
        pb.ReportRequest(session=session, report_seq=3, applied_seq=0, events=events)
    )
    assert (list(reply.stalled), reply.stalled_steps) == ([], 0)


def test_tries_in_one_report_see_the_admissions_before_them_and_the_room(
    peak_client: SidecarClient,
) -> None:
    session = open_peak(peak_client)
    events = [submit(rid, 40, shape(worst=640, budget=600)) for rid in "abc"]
    tries = [pb.Try(rid=rid) for rid in "abc"]
    request = pb.ReportRequest(
        session=session, report_seq=1, applied_seq=-1, events=events, admit=True, tries=tries,
        room=5,
    )  # fmt: skip
    reply = peak_client.report(request)
    # 40 + 40 of 100 pages: the third does not fit beside the first two.
    assert [d.rid for d in reply.decisions] == ["a", "b"]
    request = pb.ReportRequest(
        session=session, report_seq=2, applied_seq=1, events=[submit("d", 5)], admit=True,
        tries=[pb.Try(rid="c"), pb.Try(rid="d")], room=0,
    )  # fmt: skip
    assert list(peak_client.report(request).decisions) == []  # no room: nothing admitted


def test_try_first_asks_the_first_waiting_requests_in_order_with_their_hits(
    peak_client: SidecarClient,
) -> None:
    """What a serving engine sends: how many of the sidecar's queue to ask, not each rid."""
    session = open_peak(peak_client)
    events = [submit(rid, 40, shape(worst=640, budget=600)) for rid in "abc"]
    # A hit for a request past the first is not read: 99 pages would be refused.
    request = pb.ReportRequest(
        session=session, report_seq=1, applied_seq=-1, events=events, admit=True, room=5,
        try_first=1, try_hits={"c": pb.Hit(pages=99)},
    )  # fmt: skip
    assert [d.rid for d in peak_client.report(request).decisions] == ["a"]  # b fits, not asked
    request = pb.ReportRequest(
        session=session, report_seq=2, applied_seq=0, admit=True, room=1, try_first=9,
        try_hits={"b": pb.Hit()},
    )  # fmt: skip
    reply = peak_client.report(request)
    assert ([d.rid for d in reply.decisions], reply.waiting) == (["b"], 1)  # the room: one


def test_a_try_for_a_request_that_is_not_waiting_admits_nothing(
    peak_client: SidecarClient,
) -> None:
    session = open_peak(peak_client)
    reply = peak_client.report(ask(session, 1, -1, pb.Try(rid="x", hit=pb.Hit())))
    assert (list(reply.decisions), reply.waiting) == ([], 0)
    assert peak_client.status_reply().pool.outstanding == 0


def test_a_stalled_step_is_reported_and_counted_in_the_sidecar_metrics() -> None:
    proc, port, metrics_port = spawn_sidecar("--metrics-port", "0", "--policy", "peak")
    try:
        with SidecarClient(f"127.0.0.1:{port}", retry_budget_s=2.0) as client:
            session = open_peak(client)
            client.report(
                ask(session, 1, -1, pb.Try(rid="a", hit=pb.Hit()), submit("a", 10, shape()))
            )
            end = pb.Event(end_step=pb.EndStep())
            steps = [
                ([progress("a", 1, 33), end], [], 0),
                ([end], ["a"], 1),  # a step closed with no progress from `a`
                ([progress("a", 2, 34), end], [], 1),
            ]
            for seq, (events, stalled, count) in enumerate(steps, start=2):
                reply = client.report(
                    pb.ReportRequest(session=session, report_seq=seq, applied_seq=0, events=events)
                )
                assert (list(reply.stalled), reply.stalled_steps) == (stalled, count)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        scrape = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        stop_process(proc)
    assert "\nkvbank_peak_stalled_steps_total 1.0\n" in scrape


def test_an_engine_asking_for_another_policy_or_no_pace_is_refused(
    peak_client: SidecarClient,
) -> None:
    before = peak_client.status_reply()
    cases: list[tuple[pb.OpenSessionRequest, str, str]] = [
        (pb.OpenSessionRequest(total_pages=101), "FAILED_PRECONDITION", "--policy banker"),
        (
            pb.OpenSessionRequest(total_pages=101, policy="peak+backfill", pace=PACE),
            "FAILED_PRECONDITION",
            "admits by the peak+backfill policy but this sidecar's ledger runs peak",
        ),
        (pb.OpenSessionRequest(total_pages=101, policy="peak"), "INVALID_ARGUMENT", "pace"),
        (
            pb.OpenSessionRequest(total_pages=101, policy="peak", pace=pb.LedgerPace(page_size=0)),
            "INVALID_ARGUMENT",
            "page_size 0 must be >= 1",
        ),
    ]
    for request, code, words in cases:
        with pytest.raises(SidecarError) as caught:
            peak_client.open_session(request)
        assert (caught.value.code, words in caught.value.message) == (code, True), caught.value
    assert peak_client.status_reply() == before


@pytest.fixture
def mid_pass(peak_client: SidecarClient) -> tuple[SidecarClient, int]:
    """A peak session with `a` running (10 reserved, admitted in step) and `b` waiting."""
    session = open_peak(peak_client)
    events = (submit("a", 10, shape()), submit("b", 10))
    peak_client.report(ask(session, 1, -1, pb.Try(rid="a", hit=pb.Hit()), *events))
    peak_client.report(ask(session, 2, 0, pb.Try(rid="b", no_room=True)))
    return peak_client, session


def progress(rid: str, produced: int, tokens: int) -> pb.Event:
    return pb.Event(
        advance=pb.Progress(rid=rid, tokens_per_label={"full": tokens}, produced=produced)
    )


def first(session: int, **fields: Any) -> pb.ReportRequest:
    """A report asking about the first waiting requests (`try_first`), as a non-waiting engine
    sends it."""
    return pb.ReportRequest(session=session, report_seq=3, applied_seq=0, admit=True, **fields)


BAD: dict[str, tuple[Callable[[int], pb.ReportRequest], str, str]] = {
    "sole pages beyond the held part": (
        lambda s: ask(s, 3, 0, pb.Try(rid="b", hit=pb.Hit(pages=4, idle_pages=2, sole_pages=3))),
        "INVALID_ARGUMENT",
        "sole_pages 3 <= pages - idle_pages 2",
    ),
    "a hit larger than the request": (
        lambda s: ask(s, 3, 0, pb.Try(rid="b", hit=pb.Hit(pages=11))),
        "INVALID_ARGUMENT",
        "<= the request's 10 pages",
    ),
    "negative prefill chunks": (
        lambda s: ask(s, 3, 0, pb.Try(rid="b", hit=pb.Hit(), prefill_chunks=-1)),
        "INVALID_ARGUMENT",
        "prefill_chunks must be a non-negative integer, got -1",
    ),
    "a negative try_first": (
        lambda s: first(s, room=1, try_first=-1),
        "INVALID_ARGUMENT",
        "try_first must be a count >= 0 (got -1)",
    ),
    "try_first beside tries": (
        lambda s: first(s, in_step=True, try_first=2, tries=[pb.Try(rid="b", hit=pb.Hit())]),
        "INVALID_ARGUMENT",
        "send either tries or try_first",
    ),
    "a try_first hit larger than the request": (
        lambda s: first(s, room=1, try_first=1, try_hits={"b": pb.Hit(pages=11)}),
        "INVALID_ARGUMENT",
        "<= the request's 10 pages",
    ),
    "a try_hits key past the id bound": (
        lambda s: first(s, room=1, try_first=1, try_hits={"x" * 100_000: pb.Hit()}),
        "INVALID_ARGUMENT",
        "try_hits key is 100000 bytes; an id is at most 256 bytes",
    ),
    "a take past the reservation before a try": (
        lambda s: ask(
            s, 3, 0, pb.Try(rid="b", hit=pb.Hit()), pb.Event(take=pb.Take(rid="a", pages=11))
        ),
        "INVALID_ARGUMENT",
        "may take at most 10 more",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_try_fails_and_leaves_the_ledger_unchanged(
    mid_pass: tuple[SidecarClient, int], case: str
) -> None:
    client, session = mid_pass
    make, code, words = BAD[case]
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.report(make(session))
    assert (caught.value.code, words in caught.value.message) == (code, True), caught.value
    assert client.status_reply() == before
    reply = client.report(ask(session, 3, 0, pb.Try(rid="b", no_room=True)))
    assert (list(reply.decisions), reply.waiting) == ([], 1)  # the same report, done right


BAD_FIELDS: dict[str, tuple[pb.Event, str, str]] = {
    "a shape with too few labels": (
        submit("c", 5, pb.PeakShape(labels=["full"], base=[1, 2], per_output=[1], worst=[3])),
        "INVALID_ARGUMENT",
        "one entry per label",
    ),
    "a negative shape": (
        submit("c", 5, shape(base=-1)),
        "INVALID_ARGUMENT",
        "must be non-negative",
    ),
    "a shape whose base passes its worst": (
        submit("c", 5, shape(base=200, worst=100)),
        "INVALID_ARGUMENT",
        "base tokens exceed worst tokens: [(200, 100)]",
    ),
    "negative progress": (progress("a", -1, 33), "INVALID_ARGUMENT", "must be >= 0"),
    "progress of a waiting request": (progress("b", 1, 33), "NOT_FOUND", "'b' is not running"),
    "a start for a request admitted in step": (
        pb.Event(start=pb.Start(rid="a", prefill_chunks=1)),
        "INVALID_ARGUMENT",
        "report start only for deferred admissions",
    ),
    "a start for a waiting request": (
        pb.Event(start=pb.Start(rid="b", prefill_chunks=1)),
        "NOT_FOUND",
        "'b' is not running",
    ),
    "a start with negative prefill chunks": (
        pb.Event(start=pb.Start(rid="a", prefill_chunks=-1)),
        "INVALID_ARGUMENT",
        "prefill_chunks must be a non-negative integer",
    ),
    "more exclusive pages than held": (
        pb.Event(exclusive=pb.Exclusive(rid="a", pages=99)),
        "INVALID_ARGUMENT",
        "reports 99 exclusive pages of the",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_bad_peak_field_fails_and_leaves_the_ledger_unchanged(
    mid_pass: tuple[SidecarClient, int], case: str
) -> None:
    client, session = mid_pass
    event, code, words = BAD_FIELDS[case]
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.report(
            pb.ReportRequest(session=session, report_seq=3, applied_seq=0, events=[event])
        )
    assert (caught.value.code, words in caught.value.message) == (code, True), caught.value
    assert client.status_reply() == before


def test_the_pool_s_admission_chooses_the_ledger_unless_policy_is_given(tmp_path: Path) -> None:
    example = yaml.safe_load((ROOT / "examples" / "modelpool-llama-8b.yaml").read_text())
    pools = {}
    admissions = {
        "default": {},
        "peak": {"policy": "peak", "backfill": False},
        "peak+backfill": {"policy": "peak", "backfill": True},
        "conservative": {"policy": "conservative", "backfill": False},
    }
    for name, admission in admissions.items():
        doc = {**example, "spec": {**example["spec"], "admission": admission}}
        pools[name] = tmp_path / f"{name}.yaml"
        pools[name].write_text(yaml.safe_dump(doc))

    def policy(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        server.add_arguments(parser)
        return server.config_from_args(parser.parse_args(list(argv))).policy

    assert policy("--pool", str(pools["default"])) == "peak+backfill"
    assert policy("--pool", str(pools["peak"])) == "peak"
    assert policy("--pool", str(pools["peak+backfill"])) == "peak+backfill"
    assert policy("--pool", str(pools["peak+backfill"]), "--policy", "banker") == "banker"
    assert policy("--pool", str(pools["conservative"])) == "banker"
    assert policy() is None  # no pool, no --policy: each session runs what its engine asks
