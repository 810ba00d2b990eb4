"""Property tests: random small workloads under peak-fit and peak-fit with backfill, with the
ledger's integrity checked after every change. No admitted request is ever denied a page (the
driver allocates exactly the bound each step), nothing is preempted (the driver cannot), a head
never starts later than backfill promised where the pool reports sole pages (without them, a
known late start: the xfail below), and everything finishes."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peak_driver import Driver, Spec

from kvbank.capacity import CapacityModel, RequestShape, count_pages
from kvbank.modelpool import KvSlot

MAX_SEQ = 64


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Driver, list[Spec], int | None]:
    page_size = draw(st.sampled_from([2, 4, 8]))
    spec = draw(st.integers(0, 2))
    two_labels = draw(st.booleans())
    slots = {"main": KvSlot(1, 1, 0)}
    if two_labels:
        slots["cross"] = KvSlot(0, 0, draw(st.integers(1, 12)))
    model = CapacityModel(slots, page_size, MAX_SEQ, draw(st.integers(4, 40)), spec)
    groups = draw(st.lists(st.integers(page_size, 32), max_size=2))
    specs = draw(
        st.lists(
            st.builds(
                Spec,
                prompt=st.integers(1, 40),
                max_tokens=st.one_of(st.none(), st.integers(1, 40)),
                output=st.integers(1, 40),
                group=st.one_of(st.none(), st.integers(0, len(groups) - 1))
                if groups
                else st.none(),
                arrival=st.integers(0, 30),
            ),
            min_size=1,
            max_size=14,
        )
    )
    for s in specs:  # a request of a group starts with the group's prefix
        if s.group is not None:
            s.prompt = max(s.prompt, groups[s.group])
    worst = max(count_pages(model, RequestShape(s.prompt, s.max_tokens)).total for s in specs)
    pages = draw(st.integers(worst // 2 + 2, worst * 3 + 2))
    driver = Driver(
        model,
        pages,
        chunk=draw(st.integers(2, 24)),
        prefix_tokens=groups,
        peak=draw(st.booleans()),  # False: the conservative reading (with backfill: banker's)
        backfill=draw(st.booleans()),
        report_exclusive=(reported := draw(st.booleans())),
        seed=draw(st.integers(0, 1000)),
        # Without sole pages a head may start a step after its promise (the xfail below):
        # every page is still checked, the start step only where sole pages are reported.
        check_start_promises=reported,
    )
    concurrency = draw(st.one_of(st.none(), st.integers(1, 6)))  # None: open loop
    return driver, specs, concurrency


def run(driver: Driver, specs: list[Spec], concurrency: int | None, limit: int = 3000) -> None:
    pending = list(specs)
    submitted = 0
    live = 0
    while pending or driver.live or driver.waiting:
        if concurrency is None:
            due = [s for s in pending if s.arrival <= driver.step]
        else:
            due = pending[: max(0, concurrency - live)]
        for s in due:
            pending.remove(s)
            if driver.submit(s) is not None:
                submitted += 1
                live += 1
        live -= len(driver.run_step())
        assert driver.step < limit, f"not drained after {limit} steps: {driver.ledger.snapshot()}"
    assert len(driver.finished) == submitted


@settings(
    max_examples=int(os.environ.get("PEAK_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads())
def test_peak_fit_keeps_every_promise(case: tuple[Driver, list[Spec], int | None]) -> None:
    driver, specs, concurrency = case
    run(driver, specs, concurrency)
    assert driver.ledger.stalled_steps == 0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a known late start, not a breach")
def test_a_head_promised_a_step_starts_by_it_when_its_hit_has_unknown_sole_pages() -> None:
    """Found by the property above. A refused head's promise is reckoned with no hit ("a hit
    only helps"), but a hit whose sole part the engine does not report (`sole_pages` None: every
    held page of it may be sole) makes the ledger count every running request as returning that
    many pages fewer when it finishes, which can cost more than the hit saves. Here r9, of the
    prefix group, is promised step 45 and refused then with its hit: it starts at 46. Every page
    promise holds (no breach); the start-time promise is a step late. Strict: this test fails
    (and the marker must go) once the promise and the hit are reckoned alike."""
    model = CapacityModel({"main": KvSlot(1, 1, 0)}, 2, MAX_SEQ, 35, 0)
    driver = Driver(model, 59, chunk=4, prefix_tokens=[20], peak=True, backfill=True,
                    report_exclusive=False, seed=0)  # fmt: skip
    specs = [Spec(17, None, 31, None, 0), Spec(24, None, 15, None, 0), Spec(20, 7, 7, 0, 0),
             Spec(1, None, 11, None, 0), Spec(9, None, 5, None, 0), Spec(1, None, 19, None, 0),
             Spec(20, 15, 14, 0, 0), Spec(31, 15, 14, 0, 0), Spec(28, None, 1, None, 0),
             Spec(20, 11, 1, 0, 0), Spec(1, None, 1, None, 0)]  # fmt: skip
    run(driver, specs, None)
