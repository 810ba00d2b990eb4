"""Endpoint pickers' holds on this pod's room (the `Routing` service, sidecar/routing.py).

A picker that routes a request here holds its pages until the engine submits it, so a second
pick, by the same picker or by another replica, sees the room already taken. The ledger never
sees a hold: it is the one owner of the books, and a hold is only a claim on the figures every
picker reads. What a hold can cost is bounded: each expires after its ttl (capped at
`MAX_TTL_S`), and at most `MAX_HOLDS` are open, so a picker that dies, or a request that never
reaches the engine, takes its room back within the ttl.
"""

from __future__ import annotations

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
    QUEUE = 1  # waits here: queued behind the ledger's waiting requests
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
    """The open holds, by id, in grant order; expired ones go on every read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holds: dict[str, Hold] = {}

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
        if hold_id not in self._holds and len(self._holds) >= MAX_HOLDS:
            raise InvalidPages(
                f"{MAX_HOLDS} holds are open on this pod; a picker must release or let expire "
                "the holds of requests it did not send here",
                "hold_id",
            )
        self._holds.pop(hold_id, None)  # a renewed hold goes to the back of the queue
        self._holds[hold_id] = Hold(hold_id, pages, kind, self._clock() + ttl_s)

    def release(self, hold_id: str) -> bool:
        return self._holds.pop(hold_id, None) is not None

    def expire(self) -> int:
        """Drop the holds past their ttl; returns how many went."""
        now = self._clock()
        gone = [h for h, hold in self._holds.items() if hold.expires <= now]
        for hold_id in gone:
            del self._holds[hold_id]
        return len(gone)

    def figures(self) -> HeldFigures:
        self.expire()
        holds = list(self._holds.values())
        return HeldFigures(
            now_pages=sum(h.pages for h in holds if h.kind is HoldKind.NOW),
            queued=tuple(h.pages for h in holds if h.kind is HoldKind.QUEUE),
            best_effort_pages=sum(h.pages for h in holds if h.kind is HoldKind.BEST_EFFORT),
            count=len(holds),
        )

    def next_expiry(self) -> float | None:
        return min((h.expires for h in self._holds.values()), default=None)
