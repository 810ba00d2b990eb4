"""Which best-effort request a strict start preempts, with exact page ids, and where the victim
waits. Page size 4; a pool of 21 pages (1..20 usable, handed out from 1; a page freed last is
handed out first). Two best-effort requests run: `a` (8-token prompt, 3 pages after two steps,
9 positions computed) and `b` (22-token prompt, 6 pages, 23 positions computed). Then strict
`s` arrives with a 48-token prompt (12 pages) while 11 are free: one preemption is needed."""

from __future__ import annotations

from engine_builders import finish, tiny_model

from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.request import Request, Status
from kvbank.engine.runner import SamplingParams
from kvbank.service_class import ClassPolicy, ServiceClass, Victim

BE = ServiceClass.BEST_EFFORT


def _running_pair(victim: Victim) -> tuple[Engine, Request, Request]:
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=16)
    config = EngineConfig(model, 21, "peak+backfill", 64, classes=ClassPolicy(victim=victim))
    engine = Engine(config, VirtualRunner())
    a = engine.add_request("a", list(range(1, 9)), 8, service_class=BE)
    b = engine.add_request("b", list(range(20, 42)), 8, service_class=BE)
    engine.step()
    engine.step()
    assert (a.pages, b.pages) == ({"main": [1, 2, 9]}, {"main": [3, 4, 5, 6, 7, 8]})
    assert (a.num_computed, b.num_computed, engine.kv.free, engine.kv.reclaimable) == (9, 23, 11, 9)
    return engine, a, b


def test_newest_preempts_the_latest_arrival_and_keeps_its_full_pages_cached() -> None:
    engine, a, b = _running_pair(Victim.NEWEST)
    c = engine.add_request("c", list(range(60, 64)), 4, service_class=BE)
    s = engine.add_request("s", list(range(100, 148)), 4)
    engine.step()
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    # b's five full pages (3-7) stay cached; its partial page 8 is freed and taken first.
    assert s.pages == {"main": [8, *range(10, 21)]}
    assert (engine.kv.free, engine.kv.evictable) == (0, 5)
    assert b.output_cached and engine.kv.peek(b) == {"main": [3, 4, 5, 6, 7]}
    # Requeued under its arrival: ahead of c, which arrived after it but before the preemption.
    assert [r.rid for r in engine.sched.waiting] == ["b", "c"]
    finish(engine)
    assert (a.preemptions, b.preemptions, c.preemptions, s.preemptions) == (0, 1, 0, 0)


def test_cheapest_preempts_the_request_whose_rebuild_costs_least() -> None:
    engine, a, b = _running_pair(Victim.CHEAPEST)
    best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
    # Rebuild after losing one page: a recomputes 1 position and its page 2 (4 positions); b
    # recomputes 3 positions past its last full page and its page 7 (4 positions).
    assert (best_effort.rebuild_cost(a, 1), best_effort.rebuild_cost(b, 1)) == (5, 7)
    s = engine.add_request("s", list(range(100, 148)), 4)
    engine.step()
    assert a.status is Status.WAITING and b.status is Status.RUNNING
    assert s.pages == {"main": [9, *range(10, 21)]}
    assert (engine.kv.free, engine.kv.evictable) == (0, 2)  # a's pages 1 and 2 stay cached
    finish(engine)
    assert (a.preemptions, b.preemptions, s.preemptions) == (1, 0, 0)


def test_a_request_preempted_max_preemptions_times_runs_as_strict() -> None:
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=16)
    config = EngineConfig(model, 21, "peak+backfill", 64, classes=ClassPolicy(max_preemptions=1))
    engine = Engine(config, VirtualRunner())
    b = engine.add_request("b", list(range(20, 42)), 8, service_class=BE)
    engine.step()
    engine.step()
    engine.add_request("s", list(range(100, 160)), 4)  # 15 pages, 14 free: b must go
    engine.step()
    assert b.preemptions == 1 and b.status is Status.WAITING
    assert not b.best_effort and b.service_class is BE  # promoted; its asked class is kept
    assert b.rid in {r.rid for r in engine.policy.best_effort.strict}  # type: ignore[attr-defined]
    finish(engine)
    assert b.preemptions == 1


def test_a_victim_this_preemption_would_promote_is_spared_while_another_can_go() -> None:
    engine, a, b = _running_pair(Victim.NEWEST)
    b.preemptions = 1  # one more would promote it (max_preemptions 2): a goes instead
    s = engine.add_request("s", list(range(100, 148)), 4)
    engine.step()
    assert a.status is Status.WAITING and b.status is Status.RUNNING
    assert s.pages == {"main": [9, *range(10, 21)]}
    assert a.best_effort and a.preemptions == 1


def test_a_group_of_sequences_runs_strict_whatever_its_class() -> None:
    """A group is preempted whole or not at all: it runs (and says it runs) strict."""
    engine, _, _ = _running_pair(Victim.NEWEST)
    sampling = SamplingParams()
    group = engine.add_request(
        "g", list(range(70, 78)), 4, service_class=BE, siblings=[("g-1", sampling)]
    )
    assert not group.best_effort and group.service_class is ServiceClass.STRICT
    s = engine.add_request("s", list(range(100, 140)), 4)
    finish(engine)
    assert group.preemptions == s.preemptions == 0
