"""Endpoint pickers' holds on this pod's room (the `Routing` service, sidecar/routing.py).

A picker that routes a request here holds its pages until the engine submits it, so a second
pick, by the same picker or by another replica, sees the room already taken. The ledger never
sees a hold: it is the one owner of the books, and a hold is only a claim on the figures every
picker reads. What a hold can cost is bounded: each expires after its ttl (capped at
`MAX_TTL_S`), and at most `MAX_HOLDS` are open, so a picker that dies, or a request that never
reaches the engine, takes its room back within the ttl.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvbank.ledger import InvalidPages
from kvbank.sidecar.limits import check_id

MAX_TTL_S = 60.0
DEFAULT_TTL_S = 5.0
MAX_HOLDS = 4096


class HoldKind(Enum):
    NOW = 0  # starts at once: taken off the headroom
    QUEUE = 1  # waits here: queued behind the ledger's waiting requests (and earlier holds)
    BEST_EFFORT = 2  # runs on what strict promises leave: taken off the best-effort room


@dataclass(frozen=True)
class Hold:
    hold_id: str
    pages: int
    kind: HoldKind
    expires: float


@dataclass(frozen=True)
class HeldFigures:
    """What the open holds take, per kind."""

    now_pages: int
    queued: tuple[int, ...]  # in the order they were granted
    best_effort_pages: int
    count: int

    @property
    def pages(self) -> int:
        return self.now_pages + sum(self.queued) + self.best_effort_pages


class HoldBook:
    """The open holds, by id, with their totals kept as holds come and go, so reading them
    costs O(queued holds), not O(holds): a busy pod takes a hold per request routed to it.
    Expired holds go on every read (a heap of expiry times, stale entries skipped)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        self._expiry: list[tuple[float, str]] = []
        self._queued: dict[str, int] = {}  # QUEUE holds in grant order
        self._now_pages = 0
        self._best_effort_pages = 0

    def __len__(self) -> int:
        self.expire()
        return len(self._holds)

    def check(self, hold_id: str, pages: int, ttl_ms: int) -> float:
        """Raise InvalidPages naming the field unless the request is well formed; returns the
        ttl in seconds it gets."""
        if not hold_id:
            raise InvalidPages("hold_id must be a non-empty string", "hold_id")
        check_id(hold_id, "hold_id")
        if pages < 0:
            raise InvalidPages(f"pages must not be negative, got {pages}", "pages")
        if ttl_ms < 0:
            raise InvalidPages(f"ttl_ms must not be negative, got {ttl_ms}", "ttl_ms")
        return min(ttl_ms / 1000, MAX_TTL_S) if ttl_ms else DEFAULT_TTL_S

    def add(self, hold_id: str, pages: int, kind: HoldKind, ttl_s: float) -> None:
        """Open (or renew: a picker retrying its call) the hold `hold_id`."""
        self.expire()
        self.release(hold_id)  # a renewed hold goes to the back of the queue
        if len(self._holds) >= MAX_HOLDS:
            raise InvalidPages(
                f"{MAX_HOLDS} holds are open on this pod; a picker must release or let expire "
                "the holds of requests it did not send here",
                "hold_id",
            )
        hold = Hold(hold_id, pages, kind, self._clock() + ttl_s)
        self._holds[hold_id] = hold
        heapq.heappush(self._expiry, (hold.expires, hold_id))
        self._count(hold, 1)

    def _count(self, hold: Hold, sign: int) -> None:
        if hold.kind is HoldKind.NOW:
            self._now_pages += sign * hold.pages
        elif hold.kind is HoldKind.BEST_EFFORT:
            self._best_effort_pages += sign * hold.pages
        elif sign > 0:
            self._queued[hold.hold_id] = hold.pages
        else:
            del self._queued[hold.hold_id]

    def release(self, hold_id: str) -> bool:
        hold = self._holds.pop(hold_id, None)
        if hold is None:
            return False
        self._count(hold, -1)
        return True

    def expire(self) -> int:
        """Drop the holds past their ttl; returns how many went."""
        now, gone = self._clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            expires, hold_id = heapq.heappop(self._expiry)
            hold = self._holds.get(hold_id)
            if hold is not None and hold.expires == expires:  # else released or renewed
                self.release(hold_id)
                gone += 1
        if not self._holds:
            self._expiry.clear()
        return gone

    def figures(self) -> HeldFigures:
        self.expire()
        return HeldFigures(
            now_pages=self._now_pages,
            queued=tuple(self._queued.values()),
            best_effort_pages=self._best_effort_pages,
            count=len(self._holds),
        )
