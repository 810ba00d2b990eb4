"""The peak-fit ledger over the wire: the session's policy and pace, shapes, progress, sole
pages and the stepwise pass; every bad field gets its status and leaves the ledger as it was."""

from __future__ import annotations

import argparse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

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


def stepwise(session: int, seq: int, applied: int, *events: pb.Event) -> pb.ReportRequest:
    return pb.ReportRequest(
        session=session, report_seq=seq, applied_seq=applied, events=list(events), admit=True,
        stepwise=True,
    )  # fmt: skip


def answer(
    session: int, seq: int, applied: int, head: pb.HeadHit, *takes: pb.Event
) -> pb.ReportRequest:
    request = stepwise(session, seq, applied, *takes)
    request.resume = True
    request.hits.append(head)
    return request


def test_a_stepwise_pass_asks_for_each_head_and_admits_with_the_answers(
    peak_client: SidecarClient,
) -> None:
    session = open_peak(peak_client)
    supply = pb.Event(supply=pb.Supply(free=98, evictable=2))  # `a`'s two cached pages
    events = [supply, submit("a", 10, shape()), submit("b", 10)]
    reply = peak_client.report(stepwise(session, 1, -1, *events))
    assert (reply.peek, list(reply.decisions)) == ("a", [])
    hit = pb.Hit(pages=2, idle_pages=2, sole_pages=0)
    reply = peak_client.report(answer(session, 2, -1, pb.HeadHit(rid="a", hit=hit)))
    assert [(d.rid, d.seq, d.admit.reserved, d.admit.hit.pages) for d in reply.decisions] == [
        ("a", 0, 10, 2)
    ]
    assert reply.peek == "b"
    take = pb.Event(take=pb.Take(rid="a", pages=2))
    reply = peak_client.report(answer(session, 3, 0, pb.HeadHit(rid="b", stop=True), take))
    assert (reply.peek, list(reply.decisions), reply.waiting) == ("", [], 1)
    status = peak_client.status_reply()
    assert [(r.rid, r.reserved, r.held) for r in status.running] == [("a", 10, 4)]
    assert (status.pool.free, status.pool.evictable, status.pool.outstanding) == (96, 0, 6)
    progress = pb.Progress(rid="a", tokens_per_label={"full": 33}, produced=1, chunks_left=0)
    events = [pb.Event(advance=progress), pb.Event(end_step=pb.EndStep())]
    reply = peak_client.report(
        pb.ReportRequest(session=session, report_seq=4, applied_seq=0, events=events)
    )
    assert (list(reply.stalled), reply.stalled_steps) == ([], 0)


def test_a_stalled_step_is_reported_and_counted_in_the_sidecar_metrics() -> None:
    proc, port, metrics_port = spawn_sidecar("--metrics-port", "0", "--policy", "peak")
    try:
        with SidecarClient(f"127.0.0.1:{port}", retry_budget_s=2.0) as client:
            session = open_peak(client)
            client.report(stepwise(session, 1, -1, submit("a", 10, shape())))
            client.report(answer(session, 2, -1, pb.HeadHit(rid="a", hit=pb.Hit())))
            end = pb.Event(end_step=pb.EndStep())
            steps = [
                ([progress("a", 1, 33), end], [], 0),
                ([end], ["a"], 1),  # a step closed with no progress from `a`
                ([progress("a", 2, 34), end], [], 1),
            ]
            for seq, (events, stalled, count) in enumerate(steps, start=3):
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
    """A peak session with `a` running (10 reserved, 2 held) and a pass waiting on `b`."""
    session = open_peak(peak_client)
    peak_client.report(stepwise(session, 1, -1, submit("a", 10, shape()), submit("b", 10)))
    peak_client.report(answer(session, 2, -1, pb.HeadHit(rid="a", hit=pb.Hit())))
    return peak_client, session


def progress(rid: str, produced: int, tokens: int) -> pb.Event:
    return pb.Event(
        advance=pb.Progress(rid=rid, tokens_per_label={"full": tokens}, produced=produced)
    )


BAD: dict[str, tuple[Callable[[int], pb.ReportRequest], str, str]] = {
    "a report that does not answer the open pass": (
        lambda s: stepwise(s, 3, 0, submit("c", 3)),
        "FAILED_PRECONDITION",
        "waits for the hit of 'b'",
    ),
    "an answer for another request": (
        lambda s: answer(s, 3, 0, pb.HeadHit(rid="a", hit=pb.Hit())),
        "INVALID_ARGUMENT",
        "answers the pass's question 'b'",
    ),
    "an answer carrying a submit": (
        lambda s: answer(s, 3, 0, pb.HeadHit(rid="b", hit=pb.Hit()), submit("c", 3)),
        "INVALID_ARGUMENT",
        "only the takes",
    ),
    "sole pages beyond the held part": (
        lambda s: answer(
            s, 3, 0, pb.HeadHit(rid="b", hit=pb.Hit(pages=4, idle_pages=2, sole_pages=3))
        ),
        "INVALID_ARGUMENT",
        "sole_pages 3 <= pages - idle_pages 2",
    ),
    "negative prefill chunks": (
        lambda s: answer(s, 3, 0, pb.HeadHit(rid="b", hit=pb.Hit(), prefill_chunks=-1)),
        "INVALID_ARGUMENT",
        "prefill_chunks of 'b' must be >= 0",
    ),
    "a take past the reservation in an answer": (
        lambda s: answer(
            s, 3, 0, pb.HeadHit(rid="b", hit=pb.Hit()), pb.Event(take=pb.Take(rid="a", pages=11))
        ),
        "INVALID_ARGUMENT",
        "may take at most 10 more",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_answer_fails_and_leaves_the_pass_and_ledger_unchanged(
    mid_pass: tuple[SidecarClient, int], case: str
) -> None:
    client, session = mid_pass
    make, code, words = BAD[case]
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.report(make(session))
    assert (caught.value.code, words in caught.value.message) == (code, True), caught.value
    assert client.status_reply() == before
    reply = client.report(answer(session, 3, 0, pb.HeadHit(rid="b", stop=True)))
    assert (reply.peek, reply.waiting) == ("", 1)  # the pass goes on from where it was


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
    client.report(answer(session, 3, 0, pb.HeadHit(rid="b", stop=True)))  # close the pass
    event, code, words = BAD_FIELDS[case]
    before = client.status_reply()
    with pytest.raises(SidecarError) as caught:
        client.report(
            pb.ReportRequest(session=session, report_seq=4, applied_seq=0, events=[event])
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


def test_resume_without_an_open_pass_is_out_of_order(peak_client: SidecarClient) -> None:
    session = open_peak(peak_client)
    before = peak_client.status_reply()
    with pytest.raises(SidecarError) as caught:
        peak_client.report(answer(session, 1, -1, pb.HeadHit(rid="x", hit=pb.Hit())))
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "no admission pass is open" in caught.value.message
    assert peak_client.status_reply() == before
