"""gRPC decision round trip on loopback at a fixed decision rate, and follower lag.

    python benchmarks/sidecar_roundtrip.py [--rate 2000] [--seconds 5] [--running 64] [--unix]

Starts `kvbank sidecar` as its own process and a follower rank as another. Rank 0 (this process)
sends one report per decision on a fixed schedule (`--rate` per second): it submits a request,
releases the one admitted before, and has the head admitted, over a ledger with `--running`
requests admitted. Round trip: from sending the report to holding its decision. Follower lag:
from rank 0 holding a decision to the follower process receiving it (both read the same
monotonic clock). Prints p50/p99 of both; run it a few times and quote medians. `--unix` puts
the sidecar on a Unix socket (`--listen unix:///PATH`), as an engine in the same pod reaches it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient

ROOT = Path(__file__).resolve().parents[1]
SIDECAR = [sys.executable, "-m", "kvbank.cli", "sidecar"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def follower(address: str, until_seq: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    client = SidecarClient(address, follow_deadline_s=120)
    arrivals: dict[int, float] = {}
    next_seq = 0
    out.put("ready")
    while next_seq <= until_seq:
        for entry in client.follow("bench-rank-1", next_seq):
            arrivals[entry.seq] = time.monotonic()
            next_seq = entry.seq + 1
            if next_seq % 256 == 0:
                client.ack("bench-rank-1", entry.seq)
            if next_seq > until_seq:
                break
    out.put(arrivals)


def paced(count: int, rate: float, call: Callable[[int], object]) -> list[float]:
    """Seconds each call took, calls started on a fixed schedule (late ones at once)."""
    took = []
    start = time.monotonic() + 0.05
    for i in range(count):
        due = start + i / rate
        while (now := time.monotonic()) < due:
            pass  # spin: sleep() cannot keep a 500 us schedule
        call(i)
        took.append(time.monotonic() - now)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--unix", action="store_true", help="a Unix socket instead of TCP")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        listen = f"unix://{folder}/admission.sock" if args.unix else "127.0.0.1:0"
        sidecar = subprocess.Popen(
            [*SIDECAR, "--listen", listen, "--metrics-port", "-1"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert sidecar.stdout is not None
        match = re.search(r"serving on (\S+),", sidecar.stdout.readline())
        assert match, "the sidecar did not start"
        try:
            run(match.group(1), args)
        finally:
            sidecar.terminate()
            sidecar.wait(10)


def run(address: str, args: argparse.Namespace) -> None:
    client = SidecarClient(address)
    # Transport baseline: the cheapest call (status of a sidecar with no session), same pacing.
    baseline = paced(int(args.rate), args.rate, lambda i: client.status_reply())
    session = client.open_session(
        pb.OpenSessionRequest(engine_id="bench", total_pages=1_000_001)
    ).session
    warm = [pb.Event(submit=pb.Submit(rid=f"bg{i}", pages=10)) for i in range(args.running)]
    reply = client.report(
        pb.ReportRequest(session=session, report_seq=1, applied_seq=-1, events=warm, admit=True)
    )
    last = reply.decisions[-1].seq if reply.decisions else -1
    total = int(args.rate * args.seconds)
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    rank1 = mp.Process(target=follower, args=(address, last + total, queue), daemon=True)
    rank1.start()
    assert queue.get(timeout=30) == "ready"
    time.sleep(0.5)
    round_trips: list[float] = []
    decided_at: dict[int, float] = {}
    interval = 1.0 / args.rate
    start = time.monotonic() + 0.1
    for i in range(total):
        due = start + i * interval
        while (now := time.monotonic()) < due:
            pass  # spin: sleep() cannot keep a 500 us schedule
        events = [pb.Event(submit=pb.Submit(rid=f"r{i}", pages=10))]
        if i:
            events.append(pb.Event(release=pb.Release(rid=f"r{i - 1}")))
        reply = client.report(
            pb.ReportRequest(
                session=session, report_seq=i + 2, applied_seq=last, events=events, admit=True
            )
        )
        got = time.monotonic()
        round_trips.append(got - now)
        for d in reply.decisions:
            decided_at[d.seq] = got
            last = d.seq
    elapsed = time.monotonic() - start
    arrivals: dict[int, float] = queue.get(timeout=60)
    rank1.join(10)
    lags = [arrivals[s] - t for s, t in decided_at.items() if s in arrivals]
    us = 1e6
    print(
        f"round trip at {args.rate:.0f}/s target ({total / elapsed:.0f}/s achieved, "
        f"{args.running} running): p50 {statistics.median(round_trips) * us:.0f} us, "
        f"p99 {percentile(round_trips, 99) * us:.0f} us, max {max(round_trips) * us:.0f} us"
    )
    print(
        f"transport baseline (empty status call, {len(baseline)} at the same rate): p50 "
        f"{statistics.median(baseline) * us:.0f} us, p99 {percentile(baseline, 99) * us:.0f} us"
    )
    print(
        f"follower lag ({len(lags)} decisions): p50 {statistics.median(lags) * us:.0f} us, "
        f"p99 {percentile(lags, 99) * us:.0f} us"
    )


if __name__ == "__main__":
    main()
