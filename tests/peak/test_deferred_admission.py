"""Deferred admissions: a ledger deciding for an engine that starts its admissions later (a
sidecar the engine does not wait on) keeps each one open-ended until the engine says it started,
so however late it starts, nothing promised can break. Exact numbers on a small pool."""

from __future__ import annotations

import pytest
from ledger_pass import admit_all

from kvbank.ledger import NO_HIT, Hit, InvalidPages, Ledger, PeakPolicy, PeakShape, UnknownRequest

POLICY = PeakPolicy(4, 0, peak=True, backfill=False, max_advance=1)
# `a`: a 4-token prompt (1 page) that may write 4 more: 2 pages at worst, done within 5 steps.
A = PeakShape((4,), (1,), (8,), 4, 1, 2, ("main",))
# `b`: a 4-token prompt that may write 16 more: 5 pages at worst, reached at step 16.
B = PeakShape((4,), (1,), (20,), 16, 1, 5, ("main",))


def ledger_with_a(supply: int, deferred: bool) -> Ledger:
    ledger = Ledger(20, policy=POLICY, free=supply)
    ledger.submit("a", 2, shape=A)
    ledger.submit("b", 5, shape=B)
    admitted = admit_all(ledger, lambda rid: NO_HIT if rid == "a" else None, deferred=deferred)
    assert [d.rid for d in admitted] == ["a"]
    return ledger


def smallest_supply_admitting_b(deferred: bool, start: bool) -> int:
    for supply in range(2, 12):
        ledger = ledger_with_a(supply, deferred)
        if start:
            ledger.start("a", 1)
        if ledger.try_admit("b", NO_HIT) is not None:
            return supply
    raise AssertionError("b never fits")


def test_an_unstarted_admission_returns_nothing_until_it_starts() -> None:
    # Started, `a` finishes by step 5 and gives its 2 pages back before `b` needs its 5th page:
    # 5 pages of supply hold both. Not yet started, `a` may start at any later step, so its
    # pages may never come back in time: 2 + 5 = 7, the conservative sum.
    assert smallest_supply_admitting_b(deferred=False, start=False) == 5
    assert smallest_supply_admitting_b(deferred=True, start=False) == 7
    # Once the engine reports the start, the ledger knows as much as if it had started at once.
    assert smallest_supply_admitting_b(deferred=True, start=True) == 5


def test_an_unstarted_admission_is_never_stalled_and_its_start_sets_the_prefill_bound() -> None:
    ledger = ledger_with_a(7, deferred=True)
    for _ in range(3):  # the decision is on its way: `a` reports no progress, and is not late
        assert ledger.end_step() == []
    ledger.start("a", 2)
    ledger.take("a", 1)
    ledger.advance("a", 0, {"main": 4}, chunks_left=1)
    assert ledger.end_step() == []
    assert ledger.end_step() == ["a"]  # started, it must advance every step like any other
    assert ledger.stalled_steps == 1


def test_start_is_checked_and_a_bad_one_changes_nothing() -> None:
    ledger = ledger_with_a(7, deferred=True)
    with pytest.raises(UnknownRequest, match="'b' is not running"):
        ledger.start("b", 1)
    with pytest.raises(InvalidPages, match="prefill_chunks must be a non-negative integer"):
        ledger.start("a", -1)
    ledger.start("a", 1)
    with pytest.raises(InvalidPages, match="'a' was started already"):
        ledger.start("a", 1)
    embedded = ledger_with_a(7, deferred=False)
    with pytest.raises(InvalidPages, match="report start only for deferred admissions"):
        embedded.start("a", 1)
    # A restored request (its ledger restarted) is followed at its worst case: start is a no-op.
    ledger.restore("r", 3, 1)
    ledger.start("r", 1)


def test_exclusive_pages_between_reports_are_bounded_by_what_the_request_holds() -> None:
    ledger = ledger_with_a(7, deferred=False)
    ledger.take("a", 1)
    with pytest.raises(InvalidPages, match="reports 2 exclusive pages of the 1 it holds"):
        ledger.set_exclusive("a", 2)
    with pytest.raises(InvalidPages, match="exclusive must be a non-negative integer, got True"):
        ledger.set_exclusive("a", True)
    with pytest.raises(InvalidPages, match="exclusive must be a non-negative integer, got -1"):
        ledger.set_exclusive("a", -1)
    with pytest.raises(UnknownRequest):
        ledger.set_exclusive("nobody", 0)
    ledger.set_exclusive("a", 0)  # a pin shares its one page: it no longer returns it


def test_headroom_is_what_a_pin_may_take_with_every_promise_kept() -> None:
    conservative = Ledger(20, policy=PeakPolicy(4, peak=False), free=9)
    conservative.submit("a", 2, shape=A)
    assert conservative.try_admit("a", NO_HIT) is not None
    assert conservative.headroom == 7  # 9 - 2 outstanding
    ledger = ledger_with_a(9, deferred=True)
    assert ledger.try_admit("b", Hit(0, 0), deferred=True) is not None  # 5 more pages at worst
    # a may take 2 and b 5 at once (a open-ended), so 2 of the 9 pages are slack.
    assert ledger.headroom == 2
    ledger.start("a", 1)
    assert ledger.headroom == 4  # started, a is done and has given its 2 back before b's top
