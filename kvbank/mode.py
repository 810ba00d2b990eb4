"""The admission mode: how the ledger admits, as one value every part reads. The ModelPool's
`spec.admission` (kvbank/modelpool.py), `kvbank serve --policy` and `kvbank sidecar --policy`,
the sidecar's session (the name travels in OpenSession) and the engine's policy registry
(engine/admission/registry.py) all parse and name it here, and nowhere else.

A mode is a base, `banker` (the conservative sum of worst cases) or `peak` (peak-fit), and flags
joined with `+`: `backfill` (EASY backfill behind a blocked head). A new switch (a request class
beside the strict one, say) is a new field and a new flag here; every reader then knows it.
"""

from __future__ import annotations

from dataclasses import dataclass

BASES = ("banker", "peak")
FLAGS = ("backfill",)


@dataclass(frozen=True)
class AdmissionMode:
    peak: bool = True  # admit against the peak of the running requests' timeline
    backfill: bool = True  # let later requests start past a blocked head that they cannot delay

    @property
    def name(self) -> str:
        """`banker`, `banker+backfill`, `peak` or `peak+backfill`."""
        return ("peak" if self.peak else "banker") + ("+backfill" if self.backfill else "")

    @property
    def follows_progress(self) -> bool:
        """Whether the ledger keeps a timeline of the running requests (the banker alone does
        not: it needs no progress reports)."""
        return self.peak or self.backfill

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> AdmissionMode:
        """The mode a name gives; ValueError naming every accepted one otherwise."""
        base, *flags = str(name).split("+")
        if base not in BASES or len(set(flags)) != len(flags) or not set(flags) <= set(FLAGS):
            raise ValueError(
                f"unknown admission mode {str(name)[:64]!r}; choose one of "
                f"{', '.join(m.name for m in LEDGER_MODES)}"
            )
        return cls(peak=base == "peak", backfill="backfill" in flags)

    @classmethod
    def of_spec(cls, policy: str, backfill: bool) -> AdmissionMode:
        """A ModelPool's `spec.admission.policy` (`conservative` or `peak`) and `backfill`."""
        return cls(peak=policy == "peak", backfill=backfill)


BANKER = AdmissionMode(peak=False, backfill=False)
PEAK = AdmissionMode(peak=True, backfill=False)
PEAK_BACKFILL = AdmissionMode(peak=True, backfill=True)
BANKER_BACKFILL = AdmissionMode(peak=False, backfill=True)
# Every mode the ledger runs (in the engine or the sidecar), in the order benchmarks list them.
LEDGER_MODES = (BANKER, PEAK, PEAK_BACKFILL, BANKER_BACKFILL)
LEDGER_MODE_NAMES = tuple(mode.name for mode in LEDGER_MODES)
# What a ModelPool gets when its spec says nothing, and `kvbank serve` and `kvbank sidecar` run
# unless told otherwise (docs/benchmarks.md "Default policy").
DEFAULT_MODE = PEAK_BACKFILL
