"""The host tier: evicted prefix pages copied to host, LRU there, and reloaded on a hit, with
exact page and slot ids.

Model: page size 4, one text label; a pool of 8 pages, so page 0 is the sink and 1..7 are
usable. Pages are handed out from 1 up; a page freed last is handed out first.
"""

from __future__ import annotations

import pytest
from engine_builders import drain, make_engine, make_request, tiny_model

from kvbank.engine.bench.virtual import CostModel, VirtualRunner
from kvbank.engine.kv.cache import KVCache
from kvbank.engine.kv.host import Direction, HostMove, HostTier, chain_digest
from kvbank.engine.runner import RowInput, StepBatch
from kvbank.ledger import InvariantBreach

PROMPT = list(range(10, 23))  # 13 tokens: three full pages and one token more

TO_HOST, TO_DEVICE = Direction.TO_HOST, Direction.TO_DEVICE


def computed(kv: KVCache, rid: str, prompt: list[int], index: bool = True):  # type: ignore[no-untyped-def]
    req = make_request(rid, prompt)
    kv.grow(req, len(prompt))
    req.num_computed = len(prompt)
    if index:
        kv.index_prompt(req)
    return req


def evicted_to_host() -> KVCache:
    """Request a's three prompt pages (1, 2, 3) cached, then request b's growth evicting two
    of them, tail first: page 3 to slot 0, page 2 to slot 1."""
    kv = KVCache(8, 4, host_pages=4)
    kv.release(computed(kv, "a", PROMPT))  # 1, 2, 3 cached; 4 free
    assert (kv.free, kv.evictable) == (4, 3)
    b = computed(kv, "b", list(range(100, 124)), index=False)  # 6 pages: 4 free, 2 evicted
    assert b.pages == {"main": [4, 5, 6, 7, 3, 2]}
    assert kv.take_moves() == [HostMove(TO_HOST, 3, 0), HostMove(TO_HOST, 2, 1)]
    assert kv.take_moves() == []  # drained
    kv.release(b)
    return kv


def test_an_evicted_chain_is_copied_to_host_tail_first_only_as_far_as_needed() -> None:
    kv = evicted_to_host()
    assert kv.index.match("main", PROMPT, 3) == [1]  # page 1 stayed on the device
    assert kv.host is not None and kv.host.slots() == [0, 1] and kv.host.saved == 2
    kv.check_integrity(deep=True)


def test_a_hit_on_host_reloads_into_new_pages_and_skips_their_prefill() -> None:
    kv = evicted_to_host()
    again = make_request("a2", PROMPT)
    chains = kv.peek(again)
    assert chains == {"main": [1]}  # admission counts pages 2 and 3 as pages to allocate
    kv.lease(again, chains)
    assert [len(depth) for depth in kv.host_hit(again)] == [1, 1]
    assert kv.grow_reloading(again, len(PROMPT)) == 3
    assert again.pages == {"main": [1, 2, 3, 7]}  # b's pages, freed last first
    assert kv.take_moves() == [HostMove(TO_DEVICE, 2, 1), HostMove(TO_DEVICE, 3, 0)]
    assert (again.num_computed, again.indexed) == (12, 3)  # only the last token is computed
    assert kv.index.match("main", PROMPT, 3) == [1, 2, 3]  # indexed again
    assert kv.host.loaded == 2 and kv.host.slots() == [1, 0]  # inclusive; re-stamped
    kv.check_integrity(deep=True)
    kv.release(again)
    # Evicting a page that is already on host copies nothing.
    computed(kv, "c", list(range(200, 228)), index=False)  # 7 pages: everything goes
    moves = kv.take_moves()
    assert moves == [HostMove(TO_HOST, 1, 2)]  # pages 3 and 2 were on host already
    kv.check_integrity(deep=True)


def test_a_reload_leaves_the_last_prompt_token_to_compute() -> None:
    kv = evicted_to_host()
    exact = make_request("a3", PROMPT[:12])  # 12 tokens: three full pages, the last computed
    kv.lease(exact, kv.peek(exact))
    assert len(kv.host_hit(exact)) == 1  # page 2 only: page 3 holds the token that samples
    kv.grow_reloading(exact, 12)
    assert exact.num_computed == 8


def test_host_eviction_is_least_recently_used_and_skips_pinned_entries() -> None:
    host = HostTier(2)
    keys = [(1, 2), (3, 4), (5, 6)]
    digests = [chain_digest(None, "main", key) for key in keys]
    assert host.save(digests[0], None, "main", keys[0], page=5)
    assert host.save(digests[1], None, "main", keys[1], page=6)
    first = host.lookup(None, "main", keys[0])
    assert first is not None and first.slot == 0
    assert host.slots() == [0, 1]  # a lookup is a peek: no re-stamp
    host.load(first, page=9)  # a use: slot 0 is now the most recent
    assert host.slots() == [1, 0]
    assert host.save(digests[2], None, "main", keys[2], page=7)  # takes slot 1, the oldest
    assert host.lookup(None, "main", keys[1]) is None
    assert host.take_moves() == [
        HostMove(TO_HOST, 5, 0), HostMove(TO_HOST, 6, 1),
        HostMove(TO_DEVICE, 9, 0), HostMove(TO_HOST, 7, 1),
    ]  # fmt: skip
    both = [host.lookup(None, "main", k) for k in (keys[0], keys[2])]
    host.pin([e for e in both if e is not None])
    assert not host.save(digests[1], None, "main", keys[1], page=8)  # all pinned: nothing copied
    host.unpin([e for e in both if e is not None])
    assert host.save(digests[1], None, "main", keys[1], page=8)
    host.check_integrity()


def test_a_lookup_checks_the_chain_not_only_the_page() -> None:
    host = HostTier(2)
    parent = chain_digest(None, "main", (1, 2))
    digest = chain_digest(parent, "main", (3, 4))
    host.save(digest, parent, "main", (3, 4), page=2)
    assert host.lookup(parent, "main", (3, 4)) is not None
    assert host.lookup(None, "main", (3, 4)) is None  # the same page after another prefix
    assert host.lookup(parent, "other", (3, 4)) is None


def test_reloading_a_dropped_entry_raises() -> None:
    host = HostTier(1)
    digest = chain_digest(None, "main", (1,))
    host.save(digest, None, "main", (1,), page=3)
    entry = host.lookup(None, "main", (1,))
    assert entry is not None
    host.save(chain_digest(None, "main", (2,)), None, "main", (2,), page=4)  # drops it
    with pytest.raises(InvariantBreach, match="host slot 0 is reloaded after it was dropped"):
        host.load(entry, page=5)


def test_a_host_tier_needs_a_page() -> None:
    with pytest.raises(ValueError, match="at least 1 page, got 0"):
        HostTier(0)


def test_the_virtual_runner_charges_each_page_moved_in_its_step() -> None:
    runner = VirtualRunner(CostModel(step_base_ms=8, host_ms_per_page=0.5))
    row = RowInput("r", [5], 4, [1, 2], sample=True)
    plain = runner.run(StepBatch(0, [row])).duration_s
    moves = [HostMove(TO_HOST, 3, 0), HostMove(TO_DEVICE, 4, 1), HostMove(TO_DEVICE, 5, 2)]
    moved = runner.run(StepBatch(1, [row], moves)).duration_s
    assert plain is not None and moved is not None
    assert moved - plain == pytest.approx(3 * 0.5 / 1000)


def test_preempted_requests_reload_their_prompts_from_host_and_all_finish() -> None:
    """The preempting baseline in a pool too small for its batch: victims' prompt pages are
    evicted to host while they wait, and readmission reloads them."""
    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=40)
    engine, runner = make_engine(24, "preempt", model, host_pages=64)
    prompts = {f"r{i}": [7, *range(30 * i, 30 * i + 20)] for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 40)
        runner.stop_after(rid, 40)
    finished, _ = drain(engine)
    assert sorted(finished) == sorted(prompts)
    host = engine.kv.host
    assert engine.sched.stats.preemptions > 0
    assert host is not None and host.saved > 0 and host.loaded > 0


def test_the_serve_metrics_report_host_pages_held_and_moved() -> None:
    from kvbank.engine.serve.http.metrics import ServeMetrics

    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=40)
    engine, runner = make_engine(24, "preempt", model, host_pages=64)
    metrics = ServeMetrics(24)
    for i in range(6):
        engine.add_request(f"r{i}", [7, *range(30 * i, 30 * i + 20)], 40)
        runner.stop_after(f"r{i}", 40)
    while engine.has_work():
        metrics.observe_step(engine, engine.step())
    host = engine.kv.host
    assert host is not None and host.loaded > 0
    sample = metrics.registry.get_sample_value
    assert sample("kvbank_host_pages") == len(host) > 0
    assert sample("kvbank_host_pages_moved_total", {"direction": "to-host"}) == host.saved
    assert sample("kvbank_host_pages_moved_total", {"direction": "to-device"}) == host.loaded
