"""A profile carried from step to step (Profile.follow) equals a rebuild from the tracks, exactly:
random sequences of a timeline's operations, the profile compared after each (or after a run of
them: a followed profile may skip several changes). These profiles are small, and one that small
is rebuilt rather than followed (FOLLOW_FROM), so the tests follow from any size. On the same
timelines, the peak-fit test's early refusal (Timeline.fits) answers as the whole curve does."""

from __future__ import annotations

from collections.abc import Callable
from unittest.mock import patch

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbank.ledger.profile
from kvbank.capacity import CapacityModel, RequestShape
from kvbank.ledger import NEVER, Hit, PeakPolicy, PeakShape, Timeline, peak_shape
from kvbank.ledger.profile import Profile
from kvbank.ledger.shape import Pace, newcomer, newcomer_at
from kvbank.modelpool import KvSlot

OPS = ["add", "add", "restore", "start", "take", "advance", "deviate", "exclusive", "step"]
OPS += ["end_step", "remove", "supply"]


def bound(timeline: Timeline, k: int) -> int:
    """Extra demand at step k, request by request in plain integers (docs/admission.md)."""
    page_size, pace = timeline.policy.page_size, timeline.pace
    total = 0
    for t in timeline.tracks.values():
        if k >= t.end:
            total -= t.exclusive
            continue
        j = max(k + (0 if t.chunks else 1), 0)
        written = pace.advance * j + pace.lookahead * min(j, 1)
        labels = zip(t.tokens, t.per_output, t.worst, strict=True)
        pages = sum(-(-min(w, x + po * written) // page_size) for x, po, w in labels)
        total += max(0, pages - t.held)
    return total


Check = Callable[[Timeline, CapacityModel, st.DataObject], None]


def assert_same_as_rebuild(timeline: Timeline) -> None:
    got = timeline.profile()
    want = Profile(timeline.tracks, timeline.policy.page_size, timeline.pace, timeline.clock)
    steps = sorted({*want.candidates.tolist(), *range(4)})
    assert want.demand(np.array(steps)).tolist() == [bound(timeline, k) for k in steps]
    assert got.candidates.tolist() == want.candidates.tolist()
    assert got.demand_at_candidates.tolist() == want.demand_at_candidates.tolist()
    assert got.peak() == want.peak()
    assert got.finishes.tolist() == want.finishes.tolist()
    ends = np.concatenate([want.candidates, want.candidates + 1])
    assert got.returned(ends).tolist() == want.returned(ends).tolist()
    assert got.returned(ends, pinned=2).tolist() == want.returned(ends, pinned=2).tolist()


def advance_as_bound(timeline: Timeline, rid: str) -> None:
    """One output token (or one prefill chunk), as the bound assumes at advance 1."""
    track = timeline.tracks[rid]
    if track.budget == NEVER:
        timeline.advance(rid, 0, None, 0, None)
        return
    chunks = max(0, track.chunks - 1)
    produced = track.produced + (1 if chunks == 0 and track.produced < track.budget else 0)
    timeline.advance(rid, produced, None, chunks, None)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_followed_profile_equals_a_rebuild(data: st.DataObject) -> None:
    with patch.object(kvbank.ledger.profile, "FOLLOW_FROM", 0):
        drive(data, lambda timeline, _model, _data: assert_same_as_rebuild(timeline))


def draw_newcomer(data: st.DataObject, model: CapacityModel) -> tuple[PeakShape, Hit]:
    """A request to add: its shape and a hit (some of it idle, some sole)."""
    shape = peak_shape(
        model,
        RequestShape(data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))),
        prefill_chunks=data.draw(st.integers(0, 3)),
    )
    pages = data.draw(st.integers(0, 3))
    idle = data.draw(st.integers(0, pages))
    return shape, Hit(pages, idle, data.draw(st.integers(0, pages - idle)))


def assert_fits_reads_the_whole_curve(
    timeline: Timeline, model: CapacityModel, data: st.DataObject
) -> None:
    """`fits` refuses early on the running peak plus the newcomer there; its answer is the
    whole curve's, for a newcomer with a hit, on supplies around the deciding one."""
    shape, hit = draw_newcomer(data, model)
    highest = timeline._highest(shape, 0, hit, None)
    for supply in range(highest + hit.idle_pages - 2, highest + hit.idle_pages + 2):
        assert timeline.fits(shape, hit, supply) == (highest <= supply - hit.idle_pages), supply


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_an_early_refusal_answers_as_the_whole_curve(data: st.DataObject) -> None:
    drive(data, assert_fits_reads_the_whole_curve)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_newcomer_at_one_step_is_the_curve_there(data: st.DataObject) -> None:
    model = draw_model(data)
    page_size, spec = model.page_size, model.speculative_tokens
    shape, hit = draw_newcomer(data, model)
    pace = Pace.of(spec, data.draw(st.sampled_from([None, 1])))
    peak = data.draw(st.booleans())
    for k in range(0, shape.prefill_chunks + shape.output_budget + 2):
        curve = newcomer(shape, pace, page_size, np.array([k]), 0, hit.pages, hit.idle_pages, peak)
        assert newcomer_at(shape, pace, page_size, k, hit.pages, hit.idle_pages, peak) == curve[0]


def draw_model(data: st.DataObject) -> CapacityModel:
    """A text model, with a fixed cross-attention label or not, pages of 1 to 16 tokens."""
    page_size = data.draw(st.sampled_from([1, 3, 4, 16]))
    slots = {"main": KvSlot(1, 1, 0)}
    if data.draw(st.booleans()):
        slots["cross"] = KvSlot(0, 0, data.draw(st.integers(1, 12)))
    return CapacityModel(
        slots, page_size, 64, data.draw(st.integers(1, 40)), data.draw(st.integers(0, 2))
    )


def drive(data: st.DataObject, check: Check) -> None:
    model = draw_model(data)
    page_size, spec = model.page_size, model.speculative_tokens
    max_advance = data.draw(st.sampled_from([None, 1]))
    policy = PeakPolicy(page_size, spec, peak=data.draw(st.booleans()), max_advance=max_advance)
    timeline = Timeline(policy)
    names = [f"r{i}" for i in range(8)]  # few names: a name comes back after its removal
    for _ in range(data.draw(st.integers(1, 60))):
        op = data.draw(st.sampled_from(OPS))
        running = sorted(timeline.tracks)
        free = [n for n in names if n not in timeline.tracks]
        if op in ("add", "restore") and free:
            rid = data.draw(st.sampled_from(free))
            if op == "restore":
                timeline.restore(rid, data.draw(st.integers(1, 9)), data.draw(st.integers(0, 9)))
                continue
            shape, hit = draw_newcomer(data, model)
            given = data.draw(st.sampled_from([shape, None]))
            deferred = given is not None and data.draw(st.booleans())  # started later
            timeline.add(rid, given, shape.pages, hit, deferred=deferred)
        elif op == "start" and timeline.unstarted:
            rid = data.draw(st.sampled_from(sorted(timeline.unstarted)))
            timeline.start(rid, data.draw(st.integers(0, 3)))
        elif op == "exclusive" and running:
            rid = data.draw(st.sampled_from(running))
            timeline.set_exclusive(rid, data.draw(st.integers(0, timeline.tracks[rid].held)))
        elif op == "take" and running:
            timeline.take(data.draw(st.sampled_from(running)), data.draw(st.integers(0, 3)))
        elif op == "advance" and running:
            advance_as_bound(timeline, data.draw(st.sampled_from(running)))
        elif op == "deviate" and running:
            rid = data.draw(st.sampled_from(running))
            track = timeline.tracks[rid]
            produced = data.draw(st.integers(track.produced, max(track.produced, track.budget)))
            told = None
            if track.labels and data.draw(st.booleans()):
                told = {
                    label: data.draw(st.integers(0, worst))
                    for label, worst in zip(track.labels, track.worst, strict=True)
                }
            chunks = data.draw(st.integers(0, track.chunks))
            exclusive = data.draw(st.one_of(st.none(), st.integers(0, track.held)))
            if timeline.check_advance(rid, produced, told, chunks, exclusive) is None:
                timeline.advance(rid, produced, told, chunks, exclusive)
        elif op == "step":  # the typical step: every request advances, some take a page
            for rid in running:
                advance_as_bound(timeline, rid)
                if data.draw(st.integers(0, 3)) == 0:
                    timeline.take(rid, 1)
            timeline.end_step()
        elif op == "end_step":
            timeline.end_step()
        elif op == "remove" and running:
            timeline.remove(data.draw(st.sampled_from(running)))
        elif op == "supply":
            timeline.supply_reported()
        if data.draw(st.integers(0, 2)):  # else the next profile follows several changes
            check(timeline, model, data)
    check(timeline, model, data)


def test_a_typical_step_evaluates_only_the_requests_that_took_a_page(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Eight decoding requests advance one token each at advance 1; one takes a page. The new
    profile evaluates that one request (out and in) at the kept candidates, and every request
    only at the new ones (the next step)."""
    model = CapacityModel({"main": KvSlot(1, 1, 0)}, 4, 64, 32, 1)
    timeline = Timeline(PeakPolicy(4, 1, max_advance=1))
    for i in range(8):
        shape = peak_shape(model, RequestShape(5 + i, 8 + 2 * i), prefill_chunks=0)
        timeline.add(f"r{i}", shape, shape.pages, Hit(0, 0, 0))
        timeline.take(f"r{i}", shape.pages - 3)
    timeline.end_step()
    timeline.profile()
    rows: list[int] = []
    evaluate = kvbank.ledger.profile.demand_of

    def counting(lines, ks):  # type: ignore[no-untyped-def]
        rows.append(len(lines.rows))
        return evaluate(lines, ks)

    monkeypatch.setattr(kvbank.ledger.profile, "demand_of", counting)
    monkeypatch.setattr(kvbank.ledger.profile, "FOLLOW_FROM", 0)
    for rid in timeline.tracks:
        advance_as_bound(timeline, rid)
    timeline.take("r3", 1)
    timeline.end_step()
    timeline.profile()
    assert rows == [1, 1, 8]  # r3 out and in at the kept candidates; all at the next step
    assert_same_as_rebuild(timeline)
