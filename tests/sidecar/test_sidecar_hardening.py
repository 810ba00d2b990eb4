"""The real `kvbank sidecar` process against hostile or mistaken callers: a supply report that
contradicts what the ledger knows is held, a queue flooded with submits, a pool `kvbank check`
refuses, and an engine started with the wrong token."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient, SidecarError

pytestmark = pytest.mark.timeout(120)


def kvbank(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit(rid: str, pages: int) -> pb.Event:
    return pb.Event(submit=pb.Submit(rid=rid, pages=pages))


@pytest.fixture
def process_client(request: pytest.FixtureRequest) -> Iterator[SidecarClient]:
    args = getattr(request, "param", ())
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug", *args)
    try:
        with SidecarClient(f"127.0.0.1:{port}", retry_budget_s=2.0) as client:
            yield client
    finally:
        stop_process(proc)


def open_1024(client: SidecarClient) -> int:
    return client.open_session(
        pb.OpenSessionRequest(engine_id="e", total_pages=1024, supply=pb.Supply(free=1023))
    ).session


def test_a_supply_report_contradicting_held_pages_is_refused(
    process_client: SidecarClient,
) -> None:
    client = process_client
    session = open_1024(client)
    first = client.report(
        pb.ReportRequest(
            session=session, report_seq=1, applied_seq=-1, events=[submit("a", 20)], admit=True
        )
    )
    assert [d.rid for d in first.decisions] == ["a"]
    before = client.status_reply()
    lying = pb.ReportRequest(
        session=session,
        report_seq=2,
        applied_seq=0,
        events=[
            pb.Event(take=pb.Take(rid="a", pages=10)),
            pb.Event(supply=pb.Supply(free=1023)),  # as if a's 10 pages were free
            submit("big", 1023),
        ],
        admit=True,
    )
    with pytest.raises(SidecarError) as info:
        client.report(lying)
    assert info.value.code == "INVALID_ARGUMENT"
    assert "supply free 1023 + evictable 0 leaves 0 of the pool's 1023 usable pages" in str(
        info.value
    )
    assert "request 'a' alone holds 10" in str(info.value)
    assert client.status_reply() == before  # the ledger did not move
    # The honest report goes through, and the big request waits: 1023 pages are not free.
    lying.events[1].supply.free = 1013
    reply = client.report(lying)
    assert not reply.decisions
    status = client.status()
    assert (status.held, status.reserved, status.waiting) == (10, 20, 1)
    assert status.reserved <= status.usable_pages


@pytest.mark.parametrize("process_client", [("--max-waiting", "3")], indirect=True)
def test_the_waiting_queue_is_bounded(process_client: SidecarClient) -> None:
    client = process_client
    session = open_1024(client)
    flood = [submit(f"r{i}", 500) for i in range(4)]  # no admission pass: all wait
    with pytest.raises(SidecarError) as info:
        client.report(pb.ReportRequest(session=session, report_seq=1, applied_seq=-1, events=flood))
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "the queue holds 3 requests, this sidecar's --max-waiting" in info.value.message
    assert client.status().waiting == 0  # nothing of the report was queued
    client.report(pb.ReportRequest(session=session, report_seq=1, applied_seq=-1, events=flood[:3]))
    assert client.status().waiting == 3


def test_a_pool_kvbank_check_refuses_is_not_served() -> None:
    pool = ROOT / "examples" / "modelpool-unholdable.yaml"
    checked = kvbank("check", str(pool))
    assert checked.returncode == 1
    refused = kvbank("sidecar", "--pool", str(pool), "--metrics-port", "-1")
    assert refused.returncode == 2, refused.stdout
    assert "serving" not in refused.stdout
    assert "`kvbank check` refuses this pool" in refused.stderr
    assert "Raise kv.pages to at least 514" in refused.stderr


@pytest.mark.parametrize("ranks", [[], ["--tp", "2"]], ids=["one-rank", "tp2"])
def test_an_engine_with_the_wrong_token_exits_at_start_up(tmp_path: Path, ranks: list[str]) -> None:
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    right.write_text("the-token\n")
    wrong.write_text("not-the-token\n")
    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--token-file", str(right))
    try:
        serve = [sys.executable, "-m", "kvbank.cli", "serve", "--port", "0", *ranks]
        serve += ["--sidecar", f"127.0.0.1:{port}", "--sidecar-token-file", str(wrong)]
        engine = subprocess.Popen(
            serve, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _, err = engine.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            engine.kill()
            _, err = engine.communicate()
            pytest.fail(f"the engine kept running with a wrong token: {err[-2000:]}")
        assert engine.returncode == 2, err[-2000:]
        assert f"the sidecar at 127.0.0.1:{port} refused the token in --sidecar-token-file" in err
        assert "serving" not in err
        assert "Traceback" not in err
    finally:
        stop_process(proc)


def test_status_json_prints_counts_as_numbers() -> None:
    proc, port, _ = spawn_sidecar(
        "--metrics-port", "-1", "--pool", str(ROOT / "examples" / "modelpool-llama-8b.yaml")
    )
    try:
        shown = kvbank("status", f"127.0.0.1:{port}", "--json")
    finally:
        stop_process(proc)
    assert shown.returncode == 0, shown.stderr
    pool = json.loads(shown.stdout)["pool"]
    assert pool["totalPages"] == 20000 and pool["usablePages"] == 19999  # ints, not "20000"
    assert pool["outstanding"] == 0
