"""The reservation ledger, its one public face: `from kvbank.ledger import Ledger, Hit, ...`.

Inside: `ledger` (the class that admits), `books` (reservations, totals, checks), `timeline` (the
peak-fit timeline of running requests, under a `PeakPolicy`) and `conservative` (the trivial one
of a ledger without), `backfill` (EASY backfill over both), `shape` (a request's `PeakShape`
and the curves the timeline adds up), `profile` (the timeline's cached demand), `types` (the
records and errors callers pass, get back and catch).
"""

from kvbank.ledger.books import pool_usable_pages
from kvbank.ledger.ledger import Ledger
from kvbank.ledger.policy import PeakPolicy
from kvbank.ledger.shape import NEVER, PeakShape, open_ended, peak_shape
from kvbank.ledger.timeline import Timeline
from kvbank.ledger.types import (
    NO_HIT,
    Admitted,
    Decision,
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    LedgerError,
    LedgerSnapshot,
    Refused,
    Reservation,
    UnknownRequest,
)

__all__ = [
    "NEVER",
    "NO_HIT",
    "Admitted",
    "Decision",
    "DuplicateRequest",
    "Hit",
    "InvalidPages",
    "InvariantBreach",
    "Ledger",
    "LedgerError",
    "LedgerSnapshot",
    "PeakPolicy",
    "PeakShape",
    "Refused",
    "Reservation",
    "Timeline",
    "UnknownRequest",
    "open_ended",
    "peak_shape",
    "pool_usable_pages",
]
