"""The ledger's records and errors: what callers pass in (`Hit`), get back (`Admitted`,
`Refused`, `Reservation`, `LedgerSnapshot`) and catch (`LedgerError` and its kinds, which the
sidecar maps to gRPC status codes). The peak-fit timeline reads a leased hit as the same `Hit`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hit:
    """A waiting request's cached prefix: `pages` it will lease at admission, of which
    `idle_pages` only the index holds (the rest some running request already holds)."""

    pages: int = 0
    idle_pages: int = 0
    # Of the held part, pages exactly one running request holds (a policy ledger stops
    # counting them as that request's to return). None: not known, so all of the held part.
    sole_pages: int | None = None

    @property
    def sole(self) -> int:
        """Of the held part, the pages one running request held alone and no longer returns
        when it finishes (all of the held part when not known: never fewer than the truth)."""
        held = self.pages - self.idle_pages
        return held if self.sole_pages is None else min(held, self.sole_pages)


NO_HIT = Hit()


@dataclass
class Reservation:
    rid: str
    reserved: int  # worst-case pages over the request's life
    held: int  # pages it holds now: its leased hit plus what it allocated
    seq: int  # the admission decision's sequence number


@dataclass(frozen=True)
class Admitted:
    rid: str
    seq: int
    reserved: int
    hit: Hit


@dataclass(frozen=True)
class Refused:
    rid: str
    seq: int
    message: str


Decision = Admitted | Refused


class LedgerError(Exception):
    """An operation the ledger refuses; the ledger is unchanged when one is raised."""


class UnknownRequest(LedgerError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicateRequest(LedgerError):
    pass


class InvalidPages(LedgerError, ValueError):
    """A figure, id or shape the ledger cannot take: negative, past its bound, or not what the
    engine's own count would give. `field` names it where the caller knows (the sidecar sends
    it with the status); empty when the message alone says it."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvariantBreach(LedgerError, AssertionError):
    pass


@dataclass(frozen=True)
class LedgerSnapshot:
    total_pages: int
    usable_pages: int
    free: int
    evictable: int
    outstanding: int
    reserved: int
    held: int
    waiting: tuple[tuple[str, int], ...]  # (rid, worst pages) in FIFO order
    running: tuple[Reservation, ...]
    next_seq: int

    @property
    def supply(self) -> int:
        return self.free + self.evictable
