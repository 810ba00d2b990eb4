"""The page pool, the prefix index and the KV manager, with exact page ids and eviction order.

Model: page size 4, one text label; pool of 10 pages, so page 0 is the sink and 1..9 are usable.
"""

from __future__ import annotations

import pytest
from engine_builders import make_request

from kvbank.engine.kv.cache import KVCache
from kvbank.engine.kv.pages import SINK_PAGE, OutOfPages, PagePool
from kvbank.ledger import InvariantBreach


def computed(kv: KVCache, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    """A request whose whole prompt was prefilled and offered to the index."""
    req = make_request(rid, prompt)
    kv.grow(req, len(prompt))
    req.num_computed = len(prompt)
    kv.index_prompt(req)
    return req


def test_pages_are_handed_out_from_1_and_the_sink_never() -> None:
    kv = KVCache(10, 4)
    req = make_request("a", list(range(10)))
    assert kv.grow(req, 10) == 3
    assert req.pages == {"main": [1, 2, 3]}
    assert (kv.free, kv.evictable, kv.pool.held) == (6, 0, 3)
    pool = PagePool(3)
    assert [pool.allocate(), pool.allocate()] == [1, 2]
    with pytest.raises(OutOfPages):
        pool.allocate()
    assert SINK_PAGE not in pool._free


def test_growth_allocates_as_tokens_are_written_and_is_all_or_nothing() -> None:
    kv = KVCache(4, 4)  # 3 usable pages
    req = make_request("a", [1, 2, 3])
    assert kv.grow(req, 4) == 1 and req.pages["main"] == [1]
    assert kv.grow(req, 4) == 0  # still inside page 1
    assert kv.grow(req, 5) == 1 and req.pages["main"] == [1, 2]
    with pytest.raises(OutOfPages):
        kv.grow(req, 13)  # needs 2 more, 1 left
    assert req.pages["main"] == [1, 2] and kv.free == 1


def test_released_prompt_pages_stay_cached_and_a_peek_matches_full_pages_only() -> None:
    kv = KVCache(10, 4)
    a = computed(kv, "a", list(range(12)))
    kv.release(a)
    assert (kv.free, kv.evictable, kv.pool.cached) == (6, 3, 3)
    # The whole prompt matches, but at least one position is left to compute.
    assert kv.peek(make_request("b", list(range(12)))) == {"main": [1, 2]}
    assert kv.peek(make_request("c", [*range(12), 99])) == {"main": [1, 2, 3]}
    assert kv.peek(make_request("d", [*range(8), 50, 51, 52, 53, 54])) == {"main": [1, 2]}
    assert kv.peek(make_request("e", [7, *range(1, 12)])) == {}


def test_eviction_takes_leaves_least_recently_used_first_and_a_peek_does_not_restamp() -> None:
    kv = KVCache(10, 4)
    first = computed(kv, "a", list(range(8)))  # pages 1, 2
    second = computed(kv, "b", list(range(100, 108)))  # pages 3, 4
    kv.release(first)
    kv.release(second)
    kv.peek(make_request("p", [*range(8), 9]))  # a peek at the older chain: not a use
    assert [kv.index.evict() for _ in range(4)] == [2, 1, 4, 3]
    assert (kv.free, kv.evictable) == (9, 0)
    with pytest.raises(OutOfPages):
        kv.index.evict()


def test_a_lease_is_a_use_and_moves_its_chain_behind_the_others() -> None:
    kv = KVCache(10, 4)
    first = computed(kv, "a", list(range(8)))  # pages 1, 2
    second = computed(kv, "b", list(range(100, 108)))  # pages 3, 4
    kv.release(first)
    kv.release(second)
    reuse = make_request("r", [*range(8), 9])
    kv.lease(reuse, kv.peek(reuse))
    assert reuse.pages == {"main": [1, 2]} and reuse.num_computed == 8
    assert kv.evictable == 2  # a leased page is held, not evictable
    kv.release(reuse)
    assert [kv.index.evict() for _ in range(4)] == [4, 3, 2, 1]


def test_held_pages_are_never_evicted_and_a_held_parent_keeps_its_chain_out_of_reach() -> None:
    kv = KVCache(6, 4)  # 5 usable
    a = computed(kv, "a", list(range(12)))  # pages 1, 2, 3, all held
    b = make_request("b", [5, 5])
    kv.grow(b, 2)  # page 4
    assert kv.evictable == 0
    with pytest.raises(OutOfPages):
        kv.grow(b, 12)  # needs 2 more pages, 1 free, nothing evictable
    kv.release(a)
    assert kv.grow(b, 12) == 2  # one free page, then the least recent leaf (3)
    assert b.pages["main"] == [4, 5, 3]
    assert sorted(kv.index._nodes) == [1, 2]


def test_the_waiting_heads_pages_are_evicted_only_after_idle_ones() -> None:
    kv = KVCache(6, 4)
    head_chain = computed(kv, "a", list(range(8)))  # pages 1, 2: the head will reuse them
    idle_chain = computed(kv, "b", list(range(100, 108)))  # pages 3, 4
    kv.release(idle_chain)  # released first: normally older than the head's chain
    kv.release(head_chain)
    grower = make_request("g", [7])
    kv.grow(
        grower, 13, protected=lambda: frozenset({1, 2})
    )  # 4 pages: the free one (5), then 4, 3, and only then the leaf 2
    assert grower.pages["main"] == [5, 4, 3, 2]


def test_a_page_is_never_chained_under_a_page_only_the_index_holds() -> None:
    kv = KVCache(10, 4)
    a = computed(kv, "a", list(range(8)))  # pages 1, 2
    kv.release(a)
    b = make_request("b", [1])
    kv.grow(b, 1)  # page 3, held by b
    with pytest.raises(InvariantBreach, match="only the index holds"):
        kv.index.insert("main", 2, (8, 9, 10, 11), 3)


def test_two_requests_computing_one_prefix_index_it_once() -> None:
    kv = KVCache(10, 4)
    a = computed(kv, "a", list(range(8)))  # pages 1, 2 indexed
    b = computed(kv, "b", list(range(8)))  # pages 3, 4: same prefix, not indexed
    assert b.index_open is False and sorted(kv.index._nodes) == [1, 2]
    kv.release(b)
    assert (kv.free, kv.evictable) == (7, 0)  # b's copies went straight back to the free list
    kv.release(a)
    assert kv.evictable == 2


def test_pins_hold_a_waiting_requests_hit_within_the_idle_budget() -> None:
    kv = KVCache(10, 4)
    a = computed(kv, "a", list(range(12)))  # pages 1, 2, 3
    kv.release(a)
    waiting = make_request("w", [*range(12), 1])
    assert kv.pin(waiting, max_idle=2) == 2  # two idle pages fit the budget
    assert waiting.pinned == {"main": [1, 2]} and kv.evictable == 1
    assert kv.pin(waiting, max_idle=1) == 3  # pins only grow
    kv.unpin(waiting)
    assert kv.evictable == 3 and waiting.pinned == {}


def test_integrity_catches_counts_that_do_not_add_up() -> None:
    kv = KVCache(10, 4)
    computed(kv, "a", list(range(8)))
    kv.check_integrity(deep=True)
    kv.pool.held += 1
    with pytest.raises(InvariantBreach, match=r"free 7 \+ held 3 \+ cached 0 != 9"):
        kv.check_integrity()
