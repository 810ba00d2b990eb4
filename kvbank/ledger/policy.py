"""How a ledger that follows its running requests admits: `PeakPolicy`, the settings of the
peak-fit timeline (kvbank/ledger/timeline.py), named by the admission mode (kvbank/mode.py)
and the engine's pace."""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.ledger.shape import Pace


@dataclass(frozen=True)
class PeakPolicy:
    """How the ledger admits. `peak`: against the peak of the timeline (else the conservative
    sum of worst cases). `backfill`: a request behind a blocked head may start if it cannot
    delay the step the head is promised; at most `backfill_depth` of them are tried per pass."""

    page_size: int
    speculative_tokens: int = 0
    peak: bool = True
    backfill: bool = False
    backfill_depth: int = 8
    # Most tokens a step adds to a request: None for 1 + speculative_tokens (every draft token
    # may be accepted); 1 for an engine that writes one token per decode row.
    max_advance: int | None = None

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.speculative_tokens < 0 or self.backfill_depth < 0:
            raise ValueError(
                f"page_size {self.page_size} must be >= 1, speculative_tokens "
                f"{self.speculative_tokens} and backfill_depth {self.backfill_depth} >= 0"
            )
        Pace.of(self.speculative_tokens, self.max_advance)  # raises on a pace out of range
