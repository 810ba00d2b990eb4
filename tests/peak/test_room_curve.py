"""The room curve (kvbank/ledger/room.py) against the ledger it is read from: on random
peak-fit workloads, after every step, a newcomer the curve admits is one the ledger's own test
admits, whatever its shape; the curve admits at least what the headroom does; and a curve cut
to fewer pairs admits no more than the whole one."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peak_driver import Driver, Spec
from test_peak_properties import workloads

from kvbank.capacity import CapacityModel, RequestShape, count_pages
from kvbank.ledger import NO_HIT, Ledger, PeakShape, peak_shape
from kvbank.ledger.room import RoomCurve, room_curve
from kvbank.ledger.shape import Pace
from kvbank.modelpool import KvSlot


def ledger_admits(ledger: Ledger, shape: PeakShape) -> bool:
    """The ledger's test for a head with no hit (Ledger.try_admit's `_fits`)."""
    books = ledger.books
    if books.outstanding + shape.pages <= books.supply:
        return True
    return ledger.timeline.fits(shape, NO_HIT, books.supply)


def check_curve(ledger: Ledger, model: CapacityModel, newcomers: list[RequestShape]) -> int:
    """Assert the curve's promises on this ledger; returns how many newcomers it admitted that
    the headroom alone would not."""
    curve = room_curve(ledger)
    if curve is None:
        return 0
    assert min(curve.room) == ledger.headroom - ledger.timeline.pending_return
    beyond = 0
    for request in newcomers:
        pages = count_pages(model, request).total
        if pages > ledger.usable_pages:
            continue
        shape = peak_shape(model, request, count=count_pages(model, request))
        fits = curve.fits(shape)
        if fits:
            assert ledger_admits(ledger, shape), (curve, shape)
        if pages <= min(curve.room):
            assert fits  # a worst case within every step's room fits
        elif fits:
            beyond += 1
        for pairs in (1, 2, 5):
            assert not curve.at_most(pairs).fits(shape) or fits
    return beyond


@settings(
    max_examples=int(os.environ.get("PEAK_EXAMPLES", "150")) // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    workloads(),
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=4),
)
def test_what_the_curve_admits_the_ledger_admits(
    case: tuple[Driver, list[Spec], int | None], newcomers: list[tuple[int, int]]
) -> None:
    driver, specs, _ = case
    model = driver.model
    shapes = [RequestShape(prompt, max_tokens) for prompt, max_tokens in newcomers]
    pending = sorted(specs, key=lambda s: s.arrival)
    while pending or driver.live or driver.waiting:
        while pending and pending[0].arrival <= driver.step:
            driver.submit(pending.pop(0))
        driver.run_step()
        check_curve(driver.ledger, model, shapes)
        assert driver.step < 3000


def test_a_short_request_fits_beside_a_long_one_though_its_worst_is_over_the_headroom() -> None:
    model = CapacityModel({"main": KvSlot(1, 1, 0)}, 16, 4096, 1024, 0)
    driver = Driver(model, 101, chunk=4096, prefix_tokens=[], peak=True, backfill=False,
                    report_exclusive=True, seed=0)  # fmt: skip
    driver.submit(Spec(prompt=32, max_tokens=928, output=928, group=None, arrival=0))
    driver.run_step()
    short = RequestShape(640, 100)
    assert count_pages(model, short).total > driver.ledger.headroom  # 47 pages over 40
    assert check_curve(driver.ledger, model, [short]) == 1


@pytest.mark.parametrize(
    ("steps", "room", "page_size", "advance"),
    [((), (), 16, 1), ((0, 5), (3,), 16, 1), ((4, 2), (1, 1), 16, 1), ((0,), (1,), 0, 1),
     ((0,), (1,), 16, 0), ((-1,), (1,), 16, 1)],
)  # fmt: skip
def test_a_curve_that_does_not_hold_together_is_refused(
    steps: tuple[int, ...], room: tuple[int, ...], page_size: int, advance: int
) -> None:
    with pytest.raises(ValueError, match="room curve"):
        RoomCurve(steps, room, Pace(advance, 0), page_size)


def test_late_steps_left_with_less_than_no_room_do_not_refuse_a_request_gone_by_then() -> None:
    # A sidecar takes its holds off every step at their worst, which can leave less than no
    # room where the running requests peak late; a request gone by then is not refused there.
    model = CapacityModel({"main": KvSlot(1, 1, 0)}, 16, 4096, 1024, 0)
    curve = RoomCurve((0, 50, 900), (60, 55, -30), Pace(1, 0), 16)
    short = RequestShape(32, 16)  # gone after step 16
    assert curve.fits(peak_shape(model, short, count=count_pages(model, short)))
    long = RequestShape(32, 960)  # still running at step 900
    assert not curve.fits(peak_shape(model, long, count=count_pages(model, long)))
