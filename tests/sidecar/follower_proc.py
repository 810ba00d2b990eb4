"""A follower rank as a real process, for the fault tests: it records every decision it applies
(one line: seq rid kind) and cannot apply the one for `--poison` (its pool disagrees)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvbank.sidecar.client import SidecarClient
from kvbank.sidecar.follower import FollowedDecision, Follower, run_follower


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("record", type=Path)
    parser.add_argument("--id", default="rank-1")
    parser.add_argument("--from-seq", type=int, default=0)
    parser.add_argument("--until-seq", type=int)
    parser.add_argument("--poison", default="")
    parser.add_argument("--apply-s", type=float, default=0.0, help="time each apply takes")
    args = parser.parse_args()
    out = args.record.open("a")

    def apply(decision: FollowedDecision) -> None:
        if decision.rid == args.poison:
            raise ValueError(f"this rank's pool cannot hold {decision.rid!r}")
        time.sleep(args.apply_s)
        out.write(f"{decision.seq} {decision.rid} {type(decision).__name__}\n")
        out.flush()

    client = SidecarClient(args.address, retry_budget_s=5, follow_deadline_s=2)
    follower = Follower(
        client,
        args.id,
        apply,
        from_seq=args.from_seq,
        ack_every=4,
        ack_interval_s=0.1,
        reconnect_budget_s=5,
    )
    return run_follower(follower, args.until_seq)


if __name__ == "__main__":
    sys.exit(main())
