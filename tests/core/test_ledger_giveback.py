"""A request of several sequences gives a finished sequence's share back: exact books, a curve
that never rises, and bad numbers refused with the ledger unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbank.capacity import CapacityModel, RequestShape, count_pages
from kvbank.ledger import NO_HIT, InvalidPages, Ledger, PeakPolicy, peak_shape
from kvbank.modelpool import KvSlot

MODEL = CapacityModel({"main": KvSlot(1, 1)}, 16, 4096, 64, 0)
SHAPE = RequestShape(100, 50, sequences=4)  # 6 shared + 4 x 4 = 22 pages


def running(peak: bool) -> Ledger:
    policy = PeakPolicy(16, 0, peak=peak, backfill=True, max_advance=1)
    ledger = Ledger(101, debug=True, policy=policy)
    ledger.submit("g", 22, shape=peak_shape(MODEL, SHAPE))
    assert ledger.try_admit("g", NO_HIT) is not None
    ledger.take("g", 10)  # 6 shared + 4 x 1: the prompt
    return ledger


@pytest.mark.parametrize("peak", [True, False])
def test_a_finished_sequence_gives_its_share_and_its_pages_back(peak: bool) -> None:
    ledger = running(peak)
    assert ledger.outstanding == 12
    live = peak_shape(MODEL, SHAPE, count=count_pages(MODEL, SHAPE), live=3)
    assert live.pages == 18 and live.per_output == (3,) and live.worst == (18 * 16,)
    ledger.give_back("g", 1, 4, live)  # its own page held, its 4 pages of worst case
    res = ledger.reservation("g")
    assert (res.reserved, res.held) == (18, 9)
    assert ledger.outstanding == 9  # the 3 it would still have taken are no longer promised
    ledger.set_supply(91, 0)
    ledger.check_integrity()
    track = ledger.timeline.tracks["g"]  # type: ignore[union-attr]
    assert track.held == 9 and track.worst == (18 * 16,)


def test_bad_numbers_are_refused_and_change_nothing() -> None:
    ledger = running(True)
    live = peak_shape(MODEL, SHAPE, count=count_pages(MODEL, SHAPE), live=3)
    cases = [
        ((11, 11, None), "it cannot give back 11 reserved pages of which 11 held"),
        ((2, 1, None), "of which 2 held"),
        ((0, 16, None), "give back 16 reserved pages of which 0 held"),
        ((1, 3, live), "counts 18 worst-case pages but 19 stay reserved"),
        ((1, 4, replace(live, per_output=(5,))), "per_output (5,) rose from (4,)"),
        ((1, 4, replace(live, labels=("cfg_img",))), "gives back labels ('cfg_img',)"),
        ((-1, 4, None), "held must be a non-negative integer, got -1"),
    ]
    for (held, reserved, shape), words in cases:
        with pytest.raises(InvalidPages, match=words.replace("(", r"\(").replace(")", r"\)")):
            ledger.give_back("g", held, reserved, shape)
        res = ledger.reservation("g")
        assert (res.reserved, res.held, ledger.outstanding) == (22, 10, 12)
