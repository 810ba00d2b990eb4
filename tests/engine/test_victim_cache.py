"""A preempted request's pages become cache, its output's too: eviction takes them tail first
and only as many as a shortage needs, and readmission leases what is cached and reloads what
went to host. Exact page and slot ids.

Model: page size 4, one text label; a pool of 10 pages (1..9 usable), a host tier of 8.
"""

from __future__ import annotations

from engine_builders import make_request

from kvbank.engine.kv.cache import KVCache
from kvbank.engine.kv.host import Direction, HostMove
from kvbank.engine.kv.victims import cache_output

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17]  # two full pages
OUTPUT = [20, 21, 22, 23, 24, 25, 26, 27, 28]  # nine tokens: the ninth is not yet written


def preempted(kv: KVCache, cache: bool = True):  # type: ignore[no-untyped-def]
    victim = make_request("v", PROMPT, max_tokens=20)
    kv.grow(victim, len(PROMPT))
    victim.num_computed = len(PROMPT)
    kv.index_prompt(victim)
    victim.output = list(OUTPUT)
    kv.grow(victim, victim.num_tokens)
    victim.num_computed = victim.num_tokens - 1  # the last sampled token is written next step
    assert victim.pages == {"main": [1, 2, 3, 4, 5]}
    if cache:
        cache_output(kv, victim)
    kv.release(victim)
    return victim


def test_a_victims_full_pages_stay_cached_output_included() -> None:
    kv = KVCache(10, 4, host_pages=8)
    victim = preempted(kv)
    assert (kv.free, kv.evictable) == (5, 4)  # pages 1-4 cached, the partial page 5 freed
    assert victim.output_cached and victim.max_hit_pages == 4
    assert kv.peek(victim) == {"main": [1, 2, 3, 4]}
    kv.check_integrity(deep=True)


def test_a_shortage_evicts_the_victims_tail_only_and_readmission_reloads_it() -> None:
    kv = KVCache(10, 4, host_pages=8)
    victim = preempted(kv)
    other = make_request("w", list(range(100, 124)), max_tokens=4)
    kv.grow(other, 24)  # six pages: five free, and one evicted
    assert other.pages == {"main": [5, 6, 7, 8, 9, 4]}
    assert kv.take_moves() == [HostMove(Direction.TO_HOST, 4, 0)]  # the tail, and only it
    kv.release(other)
    chains = kv.peek(victim)
    assert chains == {"main": [1, 2, 3]}
    kv.lease(victim, chains)
    assert kv.grow_reloading(victim, victim.num_tokens) == 2
    assert victim.pages == {"main": [1, 2, 3, 4, 9]}
    assert kv.take_moves() == [HostMove(Direction.TO_DEVICE, 4, 0)]
    assert victim.num_computed == 16  # one position of 17 is computed again
    kv.check_integrity(deep=True)


def test_without_caching_its_output_only_the_prompt_stays() -> None:
    kv = KVCache(10, 4)
    victim = preempted(kv, cache=False)
    assert (kv.free, kv.evictable) == (7, 2)
    assert not victim.output_cached and victim.max_hit_pages == 2


def test_pages_only_best_effort_requests_hold_are_reclaimable() -> None:
    kv = KVCache(20, 4)
    batch = make_request("batch", list(range(12)), max_tokens=4)  # three pages
    batch.best_effort = True
    kv.grow(batch, 12)
    batch.num_computed = 12
    kv.index_prompt(batch)
    assert (kv.pool.held, kv.strict_held, kv.reclaimable) == (3, 0, 3)
    voice = make_request("voice", [*range(8), 50, 51, 52], max_tokens=4)  # shares two pages
    chains = kv.peek(voice)
    assert chains == {"main": [1, 2]}
    kv.lease(voice, chains)
    kv.grow(voice, voice.num_tokens)
    assert voice.pages == {"main": [1, 2, 4]}
    # Pages 1 and 2 now have a strict holder: preempting the batch request frees only page 3.
    assert (kv.pool.held, kv.strict_held, kv.reclaimable) == (4, 3, 1)
    kv.check_integrity(deep=True)
    kv.release(batch)
    assert (kv.pool.held, kv.strict_held, kv.reclaimable, kv.evictable) == (3, 3, 0, 1)
    kv.release(voice)
    assert (kv.pool.held, kv.strict_held, kv.reclaimable) == (0, 0, 0)
    kv.check_integrity(deep=True)
