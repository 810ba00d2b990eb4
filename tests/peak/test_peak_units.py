"""Peak-fit admission and backfill with exact numbers, worked by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest
from ledger_pass import admit_all

from kvbank.capacity import CapacityModel, RequestShape, label_growth
from kvbank.ledger import (
    Hit,
    InvalidPages,
    InvariantBreach,
    Ledger,
    PeakPolicy,
    PeakShape,
    Timeline,
    peak_shape,
)
from kvbank.modelpool import KvSlot

TEXT = {"main": KvSlot(1, 1, 0)}


def text_model(page_size: int, max_tokens: int = 32, spec: int = 0) -> CapacityModel:
    return CapacityModel(TEXT, page_size, 64, max_tokens, spec)


def decoding(timeline: Timeline, rid: str, shape: PeakShape, held: int, produced: int) -> None:
    """A running request past its prefill, holding `held` pages after `produced` tokens."""
    timeline.add(rid, shape, shape.pages, Hit(0, 0, 0))
    timeline.take(rid, held)
    timeline.advance(rid, produced, None, 0, None)


def demand(timeline: Timeline, *steps: int) -> list[int]:
    return [int(x) for x in timeline.profile().demand(np.array(steps, dtype=np.int64))]


# ---- the capacity helper ------------------------------------------------------------------------


def test_label_growth_reads_count_pages_per_label() -> None:
    # Speech at pageSize 16, one speculative token: decoder 4 + 440 + 1 = 445 tokens (28 pages),
    # the encoder window 1500 tokens (94 pages) from the start and never growing.
    model = CapacityModel(
        {"decoder": KvSlot(1, 1, 0), "cross": KvSlot(0, 0, 1500)}, 16, 448, 444, 1
    )
    growth, count = label_growth(model, RequestShape(4, 440))
    assert (growth["decoder"].base, growth["decoder"].per_output, growth["decoder"].worst) == (
        4,
        1,
        445,
    )
    assert (growth["cross"].base, growth["cross"].per_output, growth["cross"].worst) == (
        1500,
        0,
        1500,
    )
    assert count.total == 28 + 94
    shape = peak_shape(model, RequestShape(4, 440), prefill_chunks=2)
    assert shape == PeakShape((4, 1500), (1, 0), (445, 1500), 440, 2, 122, ("decoder", "cross"))


# ---- the timeline -------------------------------------------------------------------------------


def test_a_request_at_a_page_boundary_needs_the_next_page_in_the_next_step() -> None:
    # 16 tokens fill one page exactly; the next step writes token 17, which needs a second page.
    timeline = Timeline(PeakPolicy(16))
    decoding(timeline, "full", peak_shape(text_model(16), RequestShape(16, 16)), 1, 0)
    assert demand(timeline, 0, 1) == [1, 1]


def test_one_token_short_of_a_boundary_needs_no_page_until_the_step_after() -> None:
    # 15 tokens: the next step writes token 16, still in page one; the one after needs page two.
    timeline = Timeline(PeakPolicy(16))
    decoding(timeline, "short", peak_shape(text_model(16), RequestShape(15, 16)), 1, 0)
    assert demand(timeline, 0, 1) == [0, 1]


def test_speculative_tokens_advance_the_bound_by_one_plus_spec_per_step() -> None:
    # spec 1: up to 2 tokens a step. 15 tokens -> 17 at step 0 (2 pages), 19, 21 ... capped at
    # 15 + 16 + 1 = 32 tokens (2 pages); finished after 16 steps, and the page it holds now
    # is back (its growth comes back with it).
    timeline = Timeline(PeakPolicy(16, speculative_tokens=1))
    decoding(timeline, "spec", peak_shape(text_model(16, spec=1), RequestShape(15, 16)), 1, 0)
    assert demand(timeline, 0, 7, 15, 16) == [1, 1, 1, -1]


def test_a_prefill_may_end_early_so_it_grows_from_the_next_step_but_finishes_late() -> None:
    # Prompt 8 at pageSize 4, up to 3 chunks, 8 output tokens: 2 pages at step 0; its prefill
    # may end there, so 9 tokens (3 pages) at step 1 ... 16 (4 pages) from step 8; but it may
    # also take all 3 chunks, so its pages come back only after step 3 + 8 - 1 = 10.
    timeline = Timeline(PeakPolicy(4))
    shape = peak_shape(text_model(4), RequestShape(8, 8), prefill_chunks=3)
    timeline.add("chunked", shape, shape.pages, Hit(0, 0, 0))
    assert demand(timeline, 0, 1, 4, 5, 10, 11) == [2, 3, 3, 4, 4, 0]


def test_a_shared_hit_stops_the_earliest_finisher_returning_those_pages() -> None:
    # Two running requests own 3 pages each; a newcomer leases 2 pages that one of them alone
    # holds. The ledger is not told which, and either may finish first, so each gives up 2 of
    # its returns. Pages two requests already share were no one's to return: nothing changes.
    timeline = Timeline(PeakPolicy(4))
    decoding(timeline, "early", peak_shape(text_model(4), RequestShape(4, 8)), 3, 6)
    decoding(timeline, "late", peak_shape(text_model(4), RequestShape(4, 8)), 3, 0)
    newcomer = peak_shape(text_model(4), RequestShape(8, 8))
    timeline.add("new", newcomer, newcomer.pages, Hit(2, 0, 2))
    assert (timeline.tracks["early"].exclusive, timeline.tracks["late"].exclusive) == (1, 1)
    timeline.add("third", newcomer, newcomer.pages, Hit(2, 0, 0))
    assert (timeline.tracks["early"].exclusive, timeline.tracks["late"].exclusive) == (1, 1)


# ---- the ledger ---------------------------------------------------------------------------------


def two_running(policy: PeakPolicy) -> tuple[Ledger, PeakShape]:
    """pageSize 4, 8 usable pages. Prompt 4 + max_tokens 8 = 12 tokens: 3 pages worst case.
    r0 has produced 6 (10 tokens, 3 pages held, 2 steps left); r1 has just prefilled (1 page)."""
    shape = peak_shape(text_model(4), RequestShape(4, 8))
    ledger = Ledger(9, debug=True, policy=policy)
    for rid in ("r0", "r1"):
        ledger.submit(rid, shape.pages, shape=shape)
    assert [a.rid for a in admit_all(ledger)] == ["r0", "r1"]
    ledger.take("r0", 3)
    ledger.advance("r0", 6)
    ledger.take("r1", 1)
    ledger.advance("r1", 0)
    return ledger, shape


def test_peak_admits_what_the_sum_of_worst_cases_refuses() -> None:
    # Supply 4, outstanding 2: the conservative test refuses a 3-page head (2 + 3 > 4). Peak:
    # step 0: r1 +1, head prefill 1 = 2; step 1: r1 +1, head 2 pages = 3; step 2: r0 returns
    # 3 ... so the peak is 3 <= 4. A second head would need 1 + 2 + 2 = 5 at step 1: it waits.
    ledger, shape = two_running(PeakPolicy(4))
    assert (ledger.supply, ledger.outstanding) == (4, 2)
    for rid in ("r2", "r3"):
        ledger.submit(rid, shape.pages, shape=shape)
    assert [a.rid for a in admit_all(ledger)] == ["r2"]
    assert ledger.head == "r3"
    assert ledger.timeline is not None and ledger.timeline.peak() == (3, 1)
    ledger.check_integrity()


def test_the_conservative_ledger_is_unchanged_by_progress_reports() -> None:
    shape = peak_shape(text_model(4), RequestShape(4, 8))
    ledger = Ledger(9, debug=True)
    ledger.submit("r0", 3, shape=shape)
    admit_all(ledger)
    ledger.advance("r0", 5)  # accepted, ignored
    assert ledger.end_step() == [] and ledger.stalled_steps == 0
    assert ledger.outstanding == 3


def test_a_stalled_step_admits_conservatively_until_every_request_advances() -> None:
    ledger, shape = two_running(PeakPolicy(4))
    assert ledger.end_step() == []
    ledger.advance("r0", 7)  # r1 sits the step out
    assert ledger.end_step() == ["r1"]
    assert ledger.stalled_steps == 1
    ledger.submit("r2", shape.pages, shape=shape)
    assert admit_all(ledger) == []  # 2 + 3 > 4: conservative refuses
    ledger.advance("r0", 8)
    ledger.advance("r1", 1)
    assert ledger.end_step() == []
    assert [a.rid for a in admit_all(ledger)] == ["r2"]


def running_r0(policy: PeakPolicy, held: int, produced: int) -> Ledger:
    """A ledger of 10 usable pages of 4 tokens running r0 (prompt 16, 8 output), which holds
    `held` pages after `produced` output tokens."""
    ledger = Ledger(11, debug=True, policy=policy)
    r0 = peak_shape(text_model(4), RequestShape(16, 8))
    ledger.submit("r0", r0.pages, shape=r0)
    admit_all(ledger)
    ledger.take("r0", held)
    ledger.advance("r0", produced)
    return ledger


def test_backfill_starts_what_cannot_delay_the_head_and_holds_back_what_would() -> None:
    # pageSize 4, 10 usable pages; r0: prompt 16 + 8 output, 6 pages held, 2 steps left.
    # Head H (prompt 20: 5 pages at once) cannot start while supply is 4; it surely fits
    # from step 2, when r0 returns its 6 pages. B (prompt 8, 16 output, 6 pages at worst)
    # fits now but would need 5 pages beside H's 7 at step 10: 12 - 6 > 4. S (prompt 4, 4
    # output, 2 pages) fits beside H at every step.
    model = text_model(4)
    ledger = running_r0(PeakPolicy(4, backfill=True), held=6, produced=6)
    for rid, prompt, output in (("H", 20, 8), ("B", 8, 16), ("S", 4, 4)):
        shape = peak_shape(model, RequestShape(prompt, output))
        ledger.submit(rid, shape.pages, shape=shape)
    assert ledger.supply == 4
    assert [a.rid for a in admit_all(ledger)] == ["S"]
    assert ledger.promised == ("H", 2)
    assert list(ledger.snapshot().waiting) == [("H", 7), ("B", 6)]


def test_backfill_on_the_conservative_reading_uses_worst_cases() -> None:
    # Flat curves: S's 2 pages fit now (outstanding 0 + 2 <= 4) and H still fits at step 2
    # (r0's 6 back: 10 - 2 >= 7); B's 6 pages do not fit now at all.
    model = text_model(4)
    ledger = running_r0(PeakPolicy(4, peak=False, backfill=True), held=6, produced=6)
    for rid, prompt, output in (("H", 20, 8), ("B", 8, 16), ("S", 4, 4)):
        shape = peak_shape(model, RequestShape(prompt, output))
        ledger.submit(rid, shape.pages, shape=shape)
    assert [a.rid for a in admit_all(ledger)] == ["S"]
    assert ledger.promised == ("H", 2)


def test_a_request_behind_the_head_is_passed_over_unasked_only_when_no_hit_could_help() -> None:
    # pageSize 4, 10 usable pages; r0 (prompt 16, 8 output) runs holding 5 pages. The head H
    # (prompt 20, 8 output) is refused and promised. P behind it (prompt 20, 8 output) shares
    # r0's 16-token prefix: with 3 or 4 of those pages held by r0 as its hit it may start; with
    # 2 or fewer its pages at the running requests' peak step are already over the supply.
    model = text_model(4)
    ledger = running_r0(PeakPolicy(4, backfill=True), held=5, produced=1)
    for rid in ("H", "P"):
        shape = peak_shape(model, RequestShape(20, 8))
        ledger.submit(rid, shape.pages, shape=shape)
    assert ledger.try_admit("H", Hit()) is None and ledger.backfilling()
    assert [ledger.refuses_behind("P", held) for held in range(5)] == [True] * 3 + [False] * 2
    assert ledger.copy().try_admit("P", Hit(2, 0, 0)) is None
    assert ledger.copy().try_admit("P", Hit(4, 0, 0)) is not None
    assert not ledger.refuses_behind("H", 0)  # the head is always asked
    assert not ledger.refuses_behind("nobody", 0)  # try_admit says what is wrong with it


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_progress_reports_are_refused_and_change_nothing() -> None:
    ledger, _ = two_running(PeakPolicy(4))
    timeline = ledger.timeline
    assert timeline is not None
    before = (timeline.tracks["r0"].produced, timeline.tracks["r0"].tokens[:])
    with pytest.raises(InvalidPages, match="reports 5 output tokens; it had 6"):
        ledger.advance("r0", 5)
    with pytest.raises(InvalidPages, match="may produce at most 8"):
        ledger.advance("r0", 9)
    with pytest.raises(InvalidPages, match="labels"):
        ledger.advance("r0", 7, {"image": 3})
    with pytest.raises(InvalidPages, match="worst case there is 12"):
        ledger.advance("r0", 7, {"main": 13})
    with pytest.raises(InvalidPages, match="3 prefill chunks left; it had 0"):
        ledger.advance("r0", 7, chunks_left=3)
    with pytest.raises(InvalidPages, match="4 exclusive pages of its 3"):
        ledger.advance("r0", 7, exclusive=4)
    assert (timeline.tracks["r0"].produced, timeline.tracks["r0"].tokens) == before


def test_a_shape_that_disagrees_with_the_page_count_is_refused() -> None:
    ledger = Ledger(9, policy=PeakPolicy(4))
    shape = peak_shape(text_model(4), RequestShape(4, 8))
    with pytest.raises(InvalidPages, match="its shape counts 3 worst-case pages but 4"):
        ledger.submit("r0", 4, shape=shape)
    assert ledger.waiting_count() == 0


def test_integrity_names_the_step_and_numbers_of_a_breach() -> None:
    ledger, _ = two_running(PeakPolicy(4))
    ledger.set_supply(0, 0)  # the pool lost pages behind the ledger's back
    with pytest.raises(InvariantBreach, match="may need 1 more pages at step 0 from now"):
        ledger.check_integrity()


def test_a_request_without_a_shape_counts_at_its_worst_case() -> None:
    ledger = Ledger(9, debug=True, policy=PeakPolicy(4))
    ledger.submit("opaque", 5)
    ledger.submit("next", 4)
    assert [a.rid for a in admit_all(ledger, lambda rid: Hit())] == ["opaque"]
    assert ledger.head == "next"  # 5 + 4 > 8 at every step: the opaque one never finishes


def test_a_newcomer_leasing_pages_one_request_holds_alone_cannot_count_them_returning() -> None:
    # pageSize 4, 4 usable pages, one of them out of reach (a cached page eviction cannot take
    # yet). A leased a 2-page cached prefix (idle), took a third page and
    # finishes next step, when its 3 pages would come back. B (prompt 8, 8 output: 4 pages)
    # leases the same 2 pages: they stay with B, so only 1 page returns, and B needs 2 more
    # by step 5: 2 - 1 > 0 supply. Were those pages already shared by others (sole 0), A's
    # 3 pages would all return and B would fit.
    def ledger_with_a() -> Ledger:
        model = text_model(4)
        ledger = Ledger(5, debug=True, policy=PeakPolicy(4))
        ledger.set_supply(1, 2)
        a = peak_shape(model, RequestShape(8, 4))
        ledger.submit("A", a.pages, shape=a)
        assert [d.rid for d in admit_all(ledger, lambda rid: Hit(2, 2))] == ["A"]
        ledger.take("A", 1)
        ledger.advance("A", 3)
        b = peak_shape(model, RequestShape(8, 8))
        ledger.submit("B", b.pages, shape=b)
        assert ledger.supply == 0
        return ledger

    assert admit_all(ledger_with_a(), lambda rid: Hit(2, 0, sole_pages=2)) == []
    assert [d.rid for d in admit_all(ledger_with_a(), lambda rid: Hit(2, 0, 0))] == ["B"]
