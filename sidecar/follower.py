"""A follower rank's side of the decision stream: apply rank 0's decisions, in order, exactly once.

The follower keeps its own next sequence number; that is all it needs to resume. A stream that
ends (its deadline, a connection reset, the sidecar restarting) is reopened from that number
with backoff, for up to `reconnect_budget_s` without progress. Acknowledgements go every
`ack_every` decisions or `ack_interval_s` seconds, so the sidecar can drop what every rank has
applied; an ack that fails is only retried later, never waited on.

A decision the rank cannot apply (its pool disagrees, a gap in the sequence, a log that no
longer holds its next decision) means this rank no longer matches rank 0. Continuing would
corrupt its KV cache or hang a collective, so the follower stops with `FollowerDiverged`;
`run_follower` turns that into a clear message and a non-zero exit code.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbank.ledger import Admitted, Hit, Refused
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient, SidecarError, SidecarUnavailable

EXIT_DIVERGED = 3


@dataclass(frozen=True)
class Restored:
    """A request rank 0 re-registered with a restarted sidecar; it already runs on every rank
    that applied its admission."""

    rid: str
    seq: int
    reserved: int
    held: int


FollowedDecision = Admitted | Refused | Restored


class FollowerDiverged(Exception):
    pass


def decode(d: pb.Decision) -> FollowedDecision:
    kind = d.WhichOneof("outcome")
    if kind == "admit":
        return Admitted(
            d.rid, d.seq, d.admit.reserved, Hit(d.admit.hit.pages, d.admit.hit.idle_pages)
        )
    if kind == "refuse":
        return Refused(d.rid, d.seq, d.refuse.message)
    if kind == "restored":
        return Restored(d.rid, d.seq, d.restored.reserved, d.restored.held)
    raise FollowerDiverged(f"decision {d.seq} for {d.rid!r} carries no outcome")


class Follower:
    def __init__(
        self,
        client: SidecarClient,
        follower_id: str,
        apply: Callable[[FollowedDecision], None],
        from_seq: int = 0,
        ack_every: int = 64,
        ack_interval_s: float = 0.5,
        reconnect_budget_s: float = 30.0,
    ) -> None:
        self.client = client
        self.follower_id = follower_id
        self.apply = apply
        self.next_seq = from_seq
        self.ack_every = ack_every
        self.ack_interval_s = ack_interval_s
        self.reconnect_budget_s = reconnect_budget_s
        self.reconnects = 0
        self._acked = from_seq - 1
        self._acked_at = time.monotonic()

    def run(self, until_seq: int | None = None, stop: Callable[[], bool] = lambda: False) -> None:
        """Follow until decision `until_seq` is applied or `stop()` says so (checked between
        decisions and reconnects). Raises FollowerDiverged, or SidecarUnavailable when the
        sidecar stays away for the whole reconnect budget."""
        backoff, stalled_since = 0.05, time.monotonic()
        while not stop() and (until_seq is None or self.next_seq <= until_seq):
            try:
                for entry in self.client.follow(self.follower_id, self.next_seq):
                    self._apply(entry)
                    backoff, stalled_since = 0.05, time.monotonic()
                    self._maybe_ack()
                    if stop() or (until_seq is not None and self.next_seq > until_seq):
                        break
            except SidecarUnavailable as exc:
                if exc.code == "DEADLINE_EXCEEDED":  # an idle stream ran out: not a stall
                    stalled_since = time.monotonic()
                elif time.monotonic() - stalled_since > self.reconnect_budget_s:
                    raise
                self.reconnects += 1
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except SidecarError as exc:
                raise FollowerDiverged(
                    f"follower {self.follower_id!r} cannot continue at decision "
                    f"{self.next_seq}: {exc}"
                ) from exc
        self._maybe_ack(force=True)

    def _apply(self, entry: pb.Decision) -> None:
        if entry.seq != self.next_seq:
            raise FollowerDiverged(
                f"follower {self.follower_id!r} expected decision {self.next_seq} but got "
                f"{entry.seq}; the stream skipped or repeated a decision"
            )
        decision = decode(entry)
        try:
            self.apply(decision)
        except Exception as exc:
            raise FollowerDiverged(
                f"follower {self.follower_id!r} cannot apply decision {entry.seq} "
                f"({type(decision).__name__} {entry.rid!r}): {exc}; this rank no longer "
                "matches rank 0 and must restart with its group"
            ) from exc
        self.next_seq += 1

    def _maybe_ack(self, force: bool = False) -> None:
        last = self.next_seq - 1
        due = last - self._acked >= self.ack_every
        late = time.monotonic() - self._acked_at >= self.ack_interval_s
        if last <= self._acked or not (force or due or late):
            return
        try:
            self.client.ack(self.follower_id, last)
        except SidecarError:
            return  # the next ack carries it; following does not wait on acks
        self._acked, self._acked_at = last, time.monotonic()


def run_follower(follower: Follower, until_seq: int | None = None) -> int:
    """Run a follower as a rank's main loop: 0 when done, EXIT_DIVERGED (with the reason on
    stderr) when this rank cannot follow rank 0, 1 when the sidecar stayed unreachable."""
    try:
        follower.run(until_seq)
    except FollowerDiverged as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except SidecarUnavailable as exc:
        print(f"error: sidecar {follower.client.address} unreachable: {exc}", file=sys.stderr)
        return 1
    return 0
