"""How a ledger that follows its running requests admits: `PeakPolicy`, the settings of the
peak-fit timeline (kvbank/ledger/timeline.py), named by the admission mode (kvbank/mode.py)
and the engine's pace; and `PrefillPace`, the one bound a host engine keeps on every prefill
(kvbank's own engine and the vLLM plug-in alike)."""

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


@dataclass(frozen=True)
class PrefillPace:
    """The bound on a prefill the ledger relies on. The host gives every running request a
    decode row each step and serves prefill oldest first; with the running set capped below the
    step's token budget, prefill gets at least `rate` tokens a step. So a request admitted
    behind `ahead` pending prefill tokens finishes its own `own` within
    ceil((ahead + own) / rate) + 1 steps (the admission step may have no budget left for it),
    and one step more for each step its start waits on another (`later`: a group's other
    sequences start after the leader computed the shared prompt)."""

    running_cap: int
    rate: int

    @classmethod
    def of(cls, max_running: int, max_batch_tokens: int) -> PrefillPace:
        """The running cap (rows, below the token budget) and the prefill rate it leaves."""
        cap = max(1, min(max_running, max_batch_tokens - 1))
        return cls(cap, max(1, max_batch_tokens - cap))

    def bound(self, ahead: int, own: int, later: int = 0) -> int:
        return -(-(ahead + own) // self.rate) + 1 + later
