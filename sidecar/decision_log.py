"""The ordered decision log that every follower rank reads, bounded in memory.

Entries are kept by sequence number, contiguous from `first_seq` to `next_seq - 1`. An entry is
dropped once every live follower acknowledged it, or when the log outgrows `max_entries` (a
follower that far behind cannot catch up and must restart with its rank). A follower that has
neither acknowledged nor streamed for `follower_timeout_s` stops holding the log back: rank 0
never waits on a dead follower, it only loses the right to resume.

Pure Python with no I/O; the server wakes waiting streams through `on_append`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvbank.proto import admission_pb2 as pb


class LogGap(Exception):
    """The asked-for sequence number is no longer (or not yet) in the log."""


@dataclass
class FollowerMark:
    acked_seq: int  # last sequence number it applied (-1: none)
    last_seen: float


class DecisionLog:
    def __init__(
        self,
        max_entries: int = 65536,
        follower_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.follower_timeout_s = follower_timeout_s
        self._clock = clock
        self._entries: deque[pb.Decision] = deque()
        self.first_seq = 0
        self.generation = 0  # bumped by reset: streams opened before it must reconnect
        self.followers: dict[str, FollowerMark] = {}
        self.on_append: Callable[[], None] = lambda: None

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def reset(self, first_seq: int) -> None:
        """Start over at `first_seq` (a new engine session numbers from where it stands)."""
        self._entries.clear()
        self.first_seq = first_seq
        self.generation += 1
        self.on_append()  # wake streams so they see the change

    def append(self, entry: pb.Decision) -> None:
        if entry.seq != self.next_seq:
            raise LogGap(f"decision {entry.seq} appended where the log expects {self.next_seq}")
        self._entries.append(entry)
        self._trim()
        self.on_append()

    def get(self, seq: int) -> pb.Decision:
        if not self.first_seq <= seq < self.next_seq:
            raise LogGap(
                f"decision {seq} is not in the log, which holds {self.first_seq}.."
                f"{self.next_seq - 1}; a follower that far behind must restart with its rank"
            )
        return self._entries[seq - self.first_seq]

    def seen(self, follower_id: str, from_seq: int) -> None:
        """A follower (re)connected to read from `from_seq`."""
        mark = self.followers.get(follower_id)
        acked = from_seq - 1 if mark is None else max(mark.acked_seq, from_seq - 1)
        self.followers[follower_id] = FollowerMark(acked, self._clock())

    def ack(self, follower_id: str, seq: int) -> None:
        if seq >= self.next_seq:
            raise LogGap(
                f"follower {follower_id!r} acknowledged decision {seq}, but the last one made "
                f"is {self.next_seq - 1}"
            )
        mark = self.followers.get(follower_id)
        if mark is not None and seq < mark.acked_seq:
            raise LogGap(
                f"follower {follower_id!r} acknowledged {seq} after {mark.acked_seq}; "
                "acknowledgements must not go backwards"
            )
        self.followers[follower_id] = FollowerMark(seq, self._clock())
        self._trim()

    def expire_followers(self) -> list[str]:
        """Forget followers silent for longer than the timeout; returns their ids."""
        now = self._clock()
        gone = [
            fid
            for fid, mark in self.followers.items()
            if now - mark.last_seen > self.follower_timeout_s
        ]
        for fid in gone:
            del self.followers[fid]
        if gone:
            self._trim()
        return gone

    def _trim(self) -> None:
        keep_from = self.first_seq
        if self.followers:
            keep_from = min(m.acked_seq for m in self.followers.values()) + 1
        keep_from = max(keep_from, self.next_seq - self.max_entries)
        while self._entries and self.first_seq < keep_from:
            self._entries.popleft()
            self.first_seq += 1
