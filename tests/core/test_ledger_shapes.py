"""A peak shape must be what the engine's own count gives: its worst tokens fill exactly the
request's pages, and every figure lies where the timeline's int64 arithmetic is exact. The
ledger's submit refuses any other shape, naming the field, and changes nothing; every shape
the capacity function makes passes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_pass import admit_all

from kvbank.capacity import CapacityModel, RequestShape, count_pages
from kvbank.ledger import NEVER, Hit, InvalidPages, Ledger, PeakPolicy, PeakShape, peak_shape
from kvbank.ledger.shape import MAX_STEP_TOKENS
from kvbank.modelpool import MAX_PAGE_SIZE, MAX_PAGES, MAX_SPECULATIVE, KvSlot

POLICY = PeakPolicy(16, 0, max_advance=1)


def shape(
    worst: int = 160, per_output: int = 1, base: int = 32, budget: int = 128, pages: int = 10
) -> PeakShape:
    return PeakShape((base,), (per_output,), (worst,), budget, 1, pages, ("main",))


@pytest.mark.parametrize(
    ("bad", "field", "words"),
    [
        (shape(worst=161), "shape.worst", "[161] fill 11 pages of 16 tokens, but it reserves 10"),
        (shape(worst=144), "shape.worst", "fill 9 pages of 16 tokens, but it reserves 10"),
        (
            shape(worst=(1 << 63) - 8, base=(1 << 63) - 8, per_output=0),
            "shape.worst",
            "fill 576460752303423488 pages of 16 tokens",
        ),
        (shape(per_output=1 << 40), "shape.per_output", f"at most {MAX_STEP_TOKENS} are counted"),
        (shape(budget=NEVER), "shape.output_budget", f"must be below {NEVER}"),
        (shape(base=200), "shape.base", "base tokens [200] exceed worst tokens [160]"),
        (shape(pages=9), "pages", "its shape counts 9 worst-case pages but 10 were given"),
        (
            PeakShape((1, 1), (0, 0), (16, 144), 1, 1, 10, ("main", "main")),
            "shape.labels",
            "distinct names",
        ),
    ],
)
def test_a_shape_that_is_not_the_count_of_its_pages_is_refused(
    bad: PeakShape, field: str, words: str
) -> None:
    ledger = Ledger(101, debug=True, policy=POLICY)
    ledger.submit("a", 10, shape=shape())
    before = ledger.snapshot()
    with pytest.raises(InvalidPages) as caught:
        ledger.submit("b", 10, shape=bad)
    assert (caught.value.field, words in str(caught.value)) == (field, True), caught.value
    assert ledger.snapshot() == before


def test_a_count_past_the_timeline_is_refused_when_the_shape_is_made() -> None:
    for budget, chunks, field in ((NEVER + 1, 1, "output_budget"), (1, 1 << 62, "prefill_chunks")):
        with pytest.raises(InvalidPages) as caught:
            PeakShape((1,), (1,), (16,), budget, chunks, 1)
        assert caught.value.field == f"shape.{field}"


def test_a_ledger_without_a_policy_checks_what_it_reads() -> None:
    ledger = Ledger(101)
    assert ledger.submit("a", 10, shape=shape(worst=161)) is None  # it never reads the tokens
    with pytest.raises(InvalidPages, match="counts 9 worst-case pages but 10 were given"):
        ledger.submit("b", 10, shape=shape(pages=9))


@settings(max_examples=300, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 16, 64]),
    spec=st.integers(0, 4),
    slots=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 300)),
        min_size=1,
        max_size=3,
    ),
    prompt=st.integers(1, 600),
    max_tokens=st.integers(1, 400),
    sequences=st.integers(1, 5),
    data=st.data(),
)
def test_every_shape_the_capacity_function_makes_passes(
    page_size: int,
    spec: int,
    slots: list[tuple[int, int, int]],
    prompt: int,
    max_tokens: int,
    sequences: int,
    data: st.DataObject,
) -> None:
    kv_slots = {f"l{i}": KvSlot(p, o, f) for i, (p, o, f) in enumerate(slots) if p or o or f} or {
        "main": KvSlot(1, 1)
    }
    model = CapacityModel(kv_slots, page_size, 1024, 512, spec)
    request = RequestShape(prompt, max_tokens, sequences=sequences)
    count = count_pages(model, request)
    policy = PeakPolicy(page_size, spec)
    made = peak_shape(model, request, prefill_chunks=3, count=count)
    made.check("r", count.total, policy)
    live = data.draw(st.integers(1, sequences))
    left = peak_shape(model, request, count=count, live=live)  # what a give-back leaves
    left.check("r", left.pages, policy)


def test_the_timeline_is_exact_at_the_bounds() -> None:
    """The largest pool a ModelPool may have, a request at the fastest rate the check lets
    through, open-ended (counted up to step NEVER) and with a prefill bound of NEVER: the
    demand is the reservation, not a wrapped number."""
    policy = PeakPolicy(MAX_PAGE_SIZE, MAX_SPECULATIVE, backfill=True)
    ledger = Ledger(MAX_PAGES, debug=True, policy=policy)
    usable = ledger.usable_pages
    rate = MAX_STEP_TOKENS // (1 + MAX_SPECULATIVE)
    big = PeakShape((0,), (rate,), (usable * MAX_PAGE_SIZE,), NEVER - 1, NEVER, usable, ("m",))
    small = PeakShape((0,), (rate,), (MAX_PAGE_SIZE,), NEVER - 1, NEVER, 1, ("m",))
    ledger.submit("big", usable, shape=big)
    assert [a.rid for a in admit_all(ledger, deferred=True)] == ["big"]
    assert ledger.headroom == 0
    ledger.start("big", NEVER)
    assert (ledger.headroom, ledger.timeline.peak()[0]) == (0, usable)
    for rid in ("next", "later"):  # a blocked head and one behind it: a promise at a finish
        ledger.submit(rid, 1, shape=small)
    assert admit_all(ledger, deferred=True) == []
    ledger.check_integrity()


def test_a_try_with_a_bad_hit_raises_and_changes_nothing_not_even_the_prefill_bound() -> None:
    ledger = Ledger(64, policy=POLICY)
    ledger.submit("a", 10, shape=shape())
    before = (ledger.snapshot(), ledger.shape("a"))
    with pytest.raises(InvalidPages, match="a hit must satisfy"):
        ledger.try_admit("a", Hit(11, 0), prefill_chunks=7)  # more pages than it reserves
    assert (ledger.snapshot(), ledger.shape("a")) == before
    assert ledger.try_admit("a", Hit(0, 0), prefill_chunks=7) is not None
