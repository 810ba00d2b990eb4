"""In-process cost of one admission decision, and of one sidecar report without the network.

    python benchmarks/sidecar_decision_cost.py [--running 256] [--repeat 7]

1. The ledger's decision: `try_admit` admitting the head on a
   ledger with `--running` admitted requests (timed alone; a submit before and a release after
   keep the state steady).
2. The sidecar's whole report handling (`AdmissionState.report`): protobuf in, copy of the ledger
   for all-or-nothing, a submit, a release, the admission pass, the reply, the decision log.
Prints the median over `--repeat` rounds of the per-decision time (the machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvbank.ledger import Ledger
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.state import AdmissionState

POOL = 100_000


def ledger_decision_s(running: int, decisions: int) -> float:
    ledger = Ledger(POOL)
    for i in range(running):
        ledger.submit(f"bg{i}", 10)
        ledger.try_admit(f"bg{i}")
    clock = time.perf_counter
    deciding = 0.0
    for i in range(decisions):
        rid = f"r{i}"
        ledger.submit(rid, 10)
        started = clock()
        ledger.try_admit(rid)  # the decision: one comparison, then the admission's bookkeeping
        deciding += clock() - started
        ledger.release(rid)
    return deciding / decisions


def report_s(running: int, decisions: int) -> float:
    state = AdmissionState(POOL, DecisionLog(max_entries=4096))
    session = state.open_session(pb.OpenSessionRequest(total_pages=POOL)).session
    warm = [pb.Event(submit=pb.Submit(rid=f"bg{i}", pages=10)) for i in range(running)]
    state.report(
        pb.ReportRequest(session=session, report_seq=1, applied_seq=-1, events=warm, admit=True)
    )
    seq = state.ledger.next_seq - 1 if state.ledger else -1
    requests = []
    for i in range(decisions):
        events = [pb.Event(submit=pb.Submit(rid=f"r{i}", pages=10))]
        if i:
            events.append(pb.Event(release=pb.Release(rid=f"r{i - 1}")))
        requests.append(
            pb.ReportRequest(
                session=session, report_seq=i + 2, applied_seq=seq + i, events=events, admit=True
            )
        )
    started = time.perf_counter()
    for request in requests:
        state.report(request)
    return (time.perf_counter() - started) / decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    for name, measure in (("ledger decision", ledger_decision_s), ("sidecar report", report_s)):
        rounds = [measure(args.running, args.decisions) for _ in range(args.repeat)]
        print(
            f"{name:<16} running={args.running}: median {statistics.median(rounds) * 1e6:.2f} us "
            f"per decision (min {min(rounds) * 1e6:.2f}, max {max(rounds) * 1e6:.2f}; "
            f"{args.repeat} rounds x {args.decisions})"
        )


if __name__ == "__main__":
    main()
