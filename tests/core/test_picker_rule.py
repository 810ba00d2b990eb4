"""The picker's routing rule with exact picks, and its properties over random pods."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.capacity import CapacityModel, RequestShape, count_pages, usable_pages
from kvbank.ledger import Ledger, PeakPolicy, peak_shape
from kvbank.ledger.room import room_curve
from kvbank.modelpool import KvSlot
from kvbank.picker import (
    NoEndpoint,
    Pick,
    PodFigures,
    Refuse,
    Release,
    RequestCount,
    Shed,
    count_request,
    pick,
)
from kvbank.service_class import ServiceClass

BE = ServiceClass.BEST_EFFORT


def pod(name: str, headroom: int = 50, usable: int = 100, **kw) -> PodFigures:
    return PodFigures(name=name, usable_pages=usable, headroom_pages=headroom, **kw)


def strict(pages: int, blocks: tuple[int, ...] = ()) -> RequestCount:
    return RequestCount(pages=pages, prefix_blocks=blocks)


class TestStrict:
    def test_goes_where_it_is_admitted_now(self) -> None:
        pods = [pod("a", headroom=10), pod("b", headroom=30), pod("c", headroom=60)]
        assert pick(strict(20), pods) == Pick("c")  # b and c admit; c keeps the most room
        assert pick(strict(20), [pod("b", headroom=30), pod("a", headroom=30)]) == Pick("a")

    def test_a_queue_ahead_means_it_waits_there(self) -> None:
        pods = [pod("a", headroom=90, waiting_pages=(5,)), pod("b", headroom=20)]
        assert pick(strict(20), pods) == Pick("b")

    def test_ties_go_by_affinity_then_queue_depth(self) -> None:
        pods = [
            pod("a", headroom=40),
            pod("b", headroom=40, cached_blocks=frozenset({1, 2})),
            pod("c", headroom=40, cached_blocks=frozenset({2, 3})),  # no leading match
        ]
        assert pick(strict(20, (1, 2, 3)), pods) == Pick("b")

    def test_a_prefix_running_requests_hold_comes_off_the_need(self) -> None:
        held = pod(
            "a", headroom=18, cached_blocks=frozenset({1, 2, 3}), held_blocks=frozenset({1, 2})
        )
        idle = pod("b", headroom=19, cached_blocks=frozenset({1, 2, 3}))
        assert held.need(20, (1, 2, 3, 4)) == 18 and idle.need(20, (1, 2, 3, 4)) == 20
        assert pick(strict(20, (1, 2, 3, 4)), [held, idle]) == Pick("a")

    def test_with_none_admitting_it_goes_where_it_starts_soonest(self) -> None:
        pods = [
            pod("a", headroom=5, releases=(Release(4.0, 30),)),
            pod("b", headroom=5, releases=(Release(1.0, 10), Release(2.0, 10))),
            pod("c", headroom=0, waiting_pages=(40,), releases=(Release(0.5, 100),)),
        ]
        # a: short 15, covered at 4 s; b: short 15, covered at 2 s; c: short 60, at 0.5 s.
        assert pick(strict(20), pods) == Pick("c", waits=True)
        assert pods[1].start_estimate(20) == (2.0, 15)
        assert pods[0].start_estimate(200) == (math.inf, 195)

    def test_no_release_in_sight_goes_to_the_smallest_shortfall(self) -> None:
        pods = [pod("a", headroom=5), pod("b", headroom=12)]
        assert pick(strict(20), pods) == Pick("b", waits=True)


class TestRoomCurve:
    """A peak-fit pod's room curve: a request over the headroom whose pages at each step fit
    beside the running requests' is admitted now, as that pod's ledger admits it."""

    MODEL = CapacityModel({"main": KvSlot(1, 1, 0)}, 16, 4096, 1024, 0)

    def peak_pod(self, name: str, running_tokens: int) -> PodFigures:
        """A pod of 101 pages whose one running request may grow from 32 tokens to
        `running_tokens`, one a step."""
        ledger = Ledger(101, free=100, policy=PeakPolicy(16, 0, True))
        grown = RequestShape(32, running_tokens - 32)
        count = count_pages(self.MODEL, grown)
        ledger.submit("long", count.total, shape=peak_shape(self.MODEL, grown, count=count))
        assert ledger.try_admit("long") is not None
        room = room_curve(ledger)
        assert room is not None
        return pod(name, headroom=ledger.headroom, room=room)

    def test_a_short_request_over_the_headroom_goes_where_the_curve_admits_it(self) -> None:
        # 47 pages at worst, reached at step 99; pod a's running request reaches 60 pages at
        # step 927 (headroom 40), pod b's 58 at 895 (headroom 42): neither headroom holds 47.
        request = count_request(self.MODEL, RequestShape(640, 100), pool_pages_total=101)
        pods = [self.peak_pod("a", 960), self.peak_pod("b", 928)]
        assert request.pages == 47 and max(p.headroom_pages for p in pods) < 47
        assert pick(request, pods) == Pick("b")  # admitted now at both; b has more headroom
        bare = RequestCount(pages=request.pages)  # no shape: the headroom is the whole test
        assert pick(bare, pods) == Pick("b", waits=True)

    def test_a_request_whose_peak_meets_the_running_one_waits(self) -> None:
        # Growing as the running request does, from the same 32 tokens: at step 927 the two
        # may hold 60 pages each, over the 100.
        request = count_request(self.MODEL, RequestShape(32, 968), pool_pages_total=101)
        assert request.shape is not None and not self.peak_pod("a", 960).admits(request)

    def test_a_queue_ahead_still_means_it_waits(self) -> None:
        request = count_request(self.MODEL, RequestShape(640, 100), pool_pages_total=101)
        queued = replace(self.peak_pod("a", 960), waiting_pages=(1,))
        assert not queued.admits(request)


class TestBestEffort:
    def test_goes_to_the_most_room(self) -> None:
        pods = [pod("a", best_effort_room_pages=30), pod("b", best_effort_room_pages=70)]
        req = RequestCount(pages=80, service_class=BE, start_pages=20)
        assert pick(req, pods) == Pick("b")

    def test_with_no_room_now_it_queues_where_the_backlog_is_least(self) -> None:
        # Pods busy with best-effort work are not full: their queues start as it finishes.
        pods = [
            pod("a", best_effort_room_pages=10, best_effort_backlog_pages=40),
            pod("b", best_effort_room_pages=19, best_effort_backlog_pages=60),
        ]
        req = RequestCount(pages=80, service_class=BE, start_pages=20)
        assert pick(req, pods) == Pick("a", waits=True)

    def test_room_now_comes_before_a_short_backlog(self) -> None:
        pods = [
            pod("a", best_effort_room_pages=0, best_effort_backlog_pages=0),
            pod("b", best_effort_room_pages=20, best_effort_backlog_pages=70),
        ]
        assert pick(RequestCount(pages=80, service_class=BE, start_pages=20), pods) == Pick("b")

    def test_every_pod_a_pool_deep_in_backlog_is_shed(self) -> None:
        pods = [
            pod("a", best_effort_room_pages=10, best_effort_backlog_pages=81),
            pod("b", best_effort_room_pages=19, best_effort_backlog_pages=95),
        ]
        answer = pick(RequestCount(pages=80, service_class=BE, start_pages=20), pods)
        assert isinstance(answer, Shed) and answer.status == 429
        assert "needs 20 pages" in answer.message and "at least 81 pages" in answer.message
        # One pod whose backlog and the request fit its pool takes it.
        request = RequestCount(pages=80, service_class=BE, start_pages=20)
        pods[0] = replace(pods[0], best_effort_backlog_pages=80)
        assert pick(request, pods) == Pick("a", waits=True)
        # Strict requests waiting there come first: they count in the backlog.
        pods[0] = replace(pods[0], best_effort_backlog_pages=20, waiting_pages=(61,))
        assert isinstance(pick(request, pods), Shed)

    def test_a_negative_backlog_is_refused(self) -> None:
        with pytest.raises(ValueError, match="best_effort_backlog_pages"):
            pod("a", best_effort_backlog_pages=-1)


class TestRefusalsAndEndpoints:
    def test_no_ready_pod_is_503(self) -> None:
        answer = pick(strict(5), [pod("a", ready=False)])
        assert isinstance(answer, NoEndpoint) and answer.status == 503

    def test_a_request_no_pod_can_hold_gets_the_capacity_message(self) -> None:
        slots = {"main": KvSlot(prompt=1, output=1)}
        model = CapacityModel(slots, page_size=16, max_seq_len=8192, max_tokens=2048)
        shape = RequestShape(prompt_tokens=1000, max_tokens=2000)
        count = count_request(model, shape, pool_pages_total=101)
        assert count.pages == count_pages(model, shape).total == 188
        answer = pick(count, [pod("a", usable=usable_pages(101))])
        assert isinstance(answer, Refuse) and answer.status == 400
        assert answer.message == count.refusal
        assert "lower max_tokens to at most" in answer.message

    def test_only_a_pod_that_is_not_ready_could_hold_it(self) -> None:
        pods = [pod("a", headroom=10, usable=10), pod("b", usable=100, ready=False)]
        assert isinstance(pick(strict(50), pods), NoEndpoint)


class TestFigures:
    def test_headroom_past_the_pool_is_refused_with_the_numbers(self) -> None:
        with pytest.raises(ValueError, match="headroom_pages 120 must be at most usable_pages 100"):
            pod("a", headroom=120)


class TestHeadroomIsTheLedgersTest:
    def test_a_worst_case_of_headroom_pages_is_admitted_and_one_more_is_not(self) -> None:
        for extra in (0, 1):
            ledger = Ledger(101, free=70, evictable=10)
            ledger.submit("running", 30)
            assert ledger.try_admit("running") is not None
            figures = pod("a", headroom=ledger.supply - ledger.outstanding)
            pages = figures.headroom_pages + extra
            ledger.submit("new", pages)
            admitted = ledger.try_admit("new") is not None
            assert admitted == figures.admits_now(pages) == (extra == 0)


@st.composite
def pod_figures(draw) -> PodFigures:
    usable = draw(st.integers(1, 100))
    return PodFigures(
        name=draw(st.text("abcdefgh", min_size=1, max_size=3)),
        usable_pages=usable,
        headroom_pages=draw(st.integers(-10, usable)),
        waiting_pages=tuple(draw(st.lists(st.integers(1, 50), max_size=3))),
        releases=tuple(
            draw(st.lists(st.builds(Release, st.floats(0, 10), st.integers(1, 50)), max_size=3))
        ),
        best_effort_room_pages=draw(st.integers(-10, usable)),
        best_effort_backlog_pages=draw(st.integers(0, 2 * usable)),
        cached_blocks=draw(st.frozensets(st.integers(0, 5), max_size=4)),
        ready=draw(st.booleans()),
        held_blocks=draw(st.frozensets(st.integers(0, 5), max_size=3)),
    )


pods_st = st.lists(pod_figures(), min_size=1, max_size=6, unique_by=lambda p: p.name)
requests_st = st.builds(
    RequestCount,
    pages=st.integers(1, 120),
    service_class=st.sampled_from(list(ServiceClass)),
    start_pages=st.none() | st.integers(1, 60),
    prefix_blocks=st.lists(st.integers(0, 5), max_size=4).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(requests_st, pods_st)
def test_a_pick_is_a_ready_pod_that_can_hold_it(request: RequestCount, pods) -> None:
    answer = pick(request, pods)
    by_name = {p.name: p for p in pods}
    if isinstance(answer, Pick):
        chosen = by_name[answer.pod]
        assert chosen.ready and chosen.usable_pages >= request.pages
    elif isinstance(answer, NoEndpoint):
        assert not any(p.ready and p.usable_pages >= request.pages for p in pods)
    elif isinstance(answer, Refuse):
        assert all(p.usable_pages < request.pages for p in pods)
    else:  # shed: only a best-effort request, with no pod that has room or a short backlog
        assert request.service_class is BE
        need = request.pages_to_start
        assert not any(
            p.ready
            and p.usable_pages >= request.pages
            and (
                p.best_effort_room_pages >= need
                or sum(p.waiting_pages) + p.best_effort_backlog_pages + need <= p.usable_pages
            )
            for p in pods
        )


@settings(max_examples=300, deadline=None)
@given(requests_st, pods_st)
def test_a_strict_request_that_fits_somewhere_now_never_waits(request, pods) -> None:
    request = RequestCount(pages=request.pages, prefix_blocks=request.prefix_blocks)
    answer = pick(request, pods)
    blocks = request.prefix_blocks
    fits_now = [
        p
        for p in pods
        if p.ready
        and p.usable_pages >= request.pages
        and p.admits_now(p.need(request.pages, blocks))
    ]
    if fits_now:
        assert isinstance(answer, Pick) and not answer.waits
        chosen = {p.name: p for p in pods}[answer.pod]
        assert chosen.admits_now(chosen.need(request.pages, blocks))


@settings(max_examples=200, deadline=None)
@given(requests_st, pods_st)
def test_the_same_figures_give_the_same_pick_in_any_order(request, pods) -> None:
    assert pick(request, pods) == pick(request, list(reversed(pods)))
