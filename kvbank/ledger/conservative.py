"""The timeline of a ledger without a `PeakPolicy`: the conservative reading alone. It takes the
same calls as the peak-fit timeline (kvbank/ledger/timeline.py) and keeps nothing, so the ledger
reports progress the same way under every policy and never asks which timeline it holds: every
running request counts at its worst case until it is released, nothing fits beyond the
conservative test, and nothing is backfilled."""

from __future__ import annotations

from collections.abc import Mapping

from kvbank.ledger.books import Books, Waiting
from kvbank.ledger.policy import PeakPolicy
from kvbank.ledger.shape import PeakShape, flat_shape
from kvbank.ledger.types import Hit


class ConservativeTimeline:
    policy: PeakPolicy | None = None
    peak_active = False
    backfill = False
    backfill_depth = 0
    fallback = False
    stalled_steps = 0
    pending_return = 0

    def copy(self) -> ConservativeTimeline:
        return self  # it keeps no state

    def shape_of(self, waiting: Waiting, deferred: bool) -> PeakShape:
        return flat_shape(waiting.pages, 1)

    def check(self, books: Books, between_steps: bool) -> None:
        books.check_conservative()

    def headroom(self, books: Books) -> int:
        return books.supply - books.outstanding

    def fits(self, shape: PeakShape, hit: Hit, supply: int) -> bool:
        return False

    def over_at_peak(self, shape: PeakShape, hit: Hit, supply: int) -> bool:
        return True  # as `fits`: nothing is admitted behind a head

    def promise(self, rid: str, head: PeakShape, supply: int) -> int | None:
        return None

    def fits_behind(
        self, head: PeakShape, start: int, shape: PeakShape, hit: Hit, supply: int
    ) -> bool:
        return False

    def add(
        self, rid: str, shape: PeakShape | None, reserved: int, hit: Hit, deferred: bool = False
    ) -> None:
        pass

    def start(self, rid: str, prefill_chunks: int) -> None:
        pass

    def set_exclusive(self, rid: str, exclusive: int) -> None:
        pass

    def restore(self, rid: str, reserved: int, held: int) -> None:
        pass

    def remove(self, rid: str) -> None:
        pass

    def supply_reported(self) -> None:
        pass

    def take(self, rid: str, pages: int) -> None:
        pass

    def check_advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None,
        chunks_left: int,
        exclusive: int | None,
    ) -> str | None:
        return None

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None,
        chunks_left: int,
        exclusive: int | None,
    ) -> None:
        pass

    def end_step(self) -> list[str]:
        return []

    def check_give_back(self, rid: str, shape: PeakShape | None) -> str | None:
        return None

    def give_back(self, rid: str, held: int, shape: PeakShape | None) -> None:
        pass
