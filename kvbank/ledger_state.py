"""The ledger's state and its read side: the waiting queue, the running reservations, the running
total `outstanding` and the pool's `supply`, kept so that admission is one comparison
(kvbank.ledger). The mixins that make up `Ledger` (kvbank.ledger_checks, kvbank.ledger_peak,
kvbank.ledger_backfill) all build on this class, so each sees the same fields."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Self

from kvbank.capacity import SINK_PAGES
from kvbank.ledger_types import InvalidPages, LedgerSnapshot, Reservation, UnknownRequest
from kvbank.peakfit import PeakShape
from kvbank.peaktimeline import PeakPolicy, Timeline


@dataclass
class Waiting:
    """A queued request: its worst-case pages, and its shape when a policy ledger follows it."""

    pages: int
    shape: PeakShape | None = None


@dataclass
class LedgerState:
    """The fields of a `Ledger` (see there) and what reads them without changing anything."""

    total_pages: int
    debug: bool = False
    free: int = -1  # -1: every usable page starts free
    evictable: int = 0
    next_seq: int = 0
    _waiting: OrderedDict[str, Waiting] = field(default_factory=OrderedDict, repr=False)
    _running: dict[str, Reservation] = field(default_factory=dict, repr=False)
    _outstanding: int = 0
    policy: PeakPolicy | None = None
    # The last backfill promise: (head, steps from the pass that made it), None when none holds.
    promised: tuple[str, int] | None = None
    _timeline: Timeline | None = field(default=None, init=False, repr=False)
    # Set while admit_ready decides for an engine that starts its admissions later (deferred).
    _deferring: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy is not None:
            self._timeline = Timeline(self.policy)
        if self.total_pages <= SINK_PAGES:
            raise InvalidPages(
                f"a pool needs at least {SINK_PAGES + 1} pages, got {self.total_pages}"
            )
        if self.free < 0:
            self.free = self.usable_pages

    @property
    def usable_pages(self) -> int:
        return self.total_pages - SINK_PAGES

    @property
    def supply(self) -> int:
        return self.free + self.evictable

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def head(self) -> str | None:
        return next(iter(self._waiting), None)

    def waiting_count(self) -> int:
        return len(self._waiting)

    def is_waiting(self, rid: str) -> bool:
        return rid in self._waiting

    def reservation(self, rid: str) -> Reservation:
        try:
            return self._running[rid]
        except KeyError:
            raise UnknownRequest(f"request {rid!r} is not running") from None

    def running(self) -> list[Reservation]:
        return list(self._running.values())

    def snapshot(self) -> LedgerSnapshot:
        running = tuple(
            Reservation(r.rid, r.reserved, r.held, r.seq) for r in self._running.values()
        )
        return LedgerSnapshot(
            total_pages=self.total_pages,
            usable_pages=self.usable_pages,
            free=self.free,
            evictable=self.evictable,
            outstanding=self._outstanding,
            reserved=sum(r.reserved for r in running),
            held=sum(r.held for r in running),
            waiting=tuple((rid, w.pages) for rid, w in self._waiting.items()),
            running=running,
            next_seq=self.next_seq,
        )

    def copy(self) -> Self:
        """An independent ledger in the same state: a caller that applies a batch of changes
        all-or-nothing keeps one to go back to. Costs O(waiting + running)."""
        twin = replace(
            self,
            _waiting=OrderedDict(
                (rid, Waiting(w.pages, w.shape)) for rid, w in self._waiting.items()
            ),
            _running={
                rid: Reservation(r.rid, r.reserved, r.held, r.seq)
                for rid, r in self._running.items()
            },
        )
        twin._timeline = copy.deepcopy(self._timeline)
        return twin
