"""Ledger.copy with a peak policy: the copy and the original move independently (the sidecar
applies every report to a copy and keeps the original when one event fails)."""

from __future__ import annotations

from ledger_pass import admit_all

from kvbank.capacity import CapacityModel, RequestShape
from kvbank.ledger import Ledger, PeakPolicy, peak_shape
from kvbank.modelpool import KvSlot


def test_a_copy_of_a_peak_ledger_moves_without_the_original() -> None:
    model = CapacityModel({"main": KvSlot(1, 1)}, 4, 32, 32, 0)
    shape = peak_shape(model, RequestShape(4, 8))
    ledger = Ledger(12, debug=True, policy=PeakPolicy(4))
    for rid in ("r0", "r1"):
        ledger.submit(rid, shape.pages, shape=shape)
    assert [a.rid for a in admit_all(ledger)] == ["r0", "r1"]
    ledger.take("r0", 1)
    peak_before = ledger.timeline.peak() if ledger.timeline else None
    twin = ledger.copy()
    twin.take("r0", 1)
    assert twin.end_step() == []  # both were admitted in this step
    twin.advance("r0", 1, {"main": 5})
    assert twin.end_step() == ["r1"]  # r1 did not advance in the copy
    assert ledger.timeline is not None and twin.timeline is not None
    assert ledger.timeline.tracks["r0"].held == 1 and twin.timeline.tracks["r0"].held == 2
    assert ledger.timeline.tracks["r0"].tokens == [4] and twin.timeline.tracks["r0"].tokens == [5]
    assert (ledger.stalled_steps, twin.stalled_steps) == (0, 1)
    assert ledger.timeline.peak() == peak_before
    ledger.check_integrity()
