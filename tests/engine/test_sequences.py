"""n sequences from one prompt in the engine: admitted together under one reservation, sharing
the prompt's pages, finishing on their own, under every policy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_builders import drain, make_engine, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.capacity import count_pages
from kvbank.engine import sequences as groups
from kvbank.engine.admission.registry import POLICIES
from kvbank.engine.engine import Engine, RequestRejected
from kvbank.engine.request import FinishReason, Request, Status
from kvbank.engine.runner import SamplingParams

PROMPT = list(range(1, 11))  # 10 tokens at page size 4: 2 full pages, then tokens 8 and 9


def add_group(engine: Engine, rid: str, n: int, max_tokens: int = 6, prompt=PROMPT) -> Request:
    others = [(f"{rid}/{i}", SamplingParams(seed=i)) for i in range(1, n)]
    return engine.add_request(rid, list(prompt), max_tokens, siblings=others)


def group_held(req: Request) -> int:
    return groups.held(req)


def record_rows(engine: Engine) -> list[dict[str, int]]:
    """Each step's rows, by id: positions computed."""
    steps: list[dict[str, int]] = []
    run = engine.runner.run

    def recording(batch):  # type: ignore[no-untyped-def]
        steps.append({row.rid: len(row.token_ids) for row in batch.rows})
        return run(batch)

    engine.runner.run = recording  # type: ignore[method-assign]
    return steps


def test_the_sequences_share_the_prompt_pages_and_hold_exactly_the_count() -> None:
    engine, _ = make_engine(64)
    steps = record_rows(engine)
    leader = add_group(engine, "g", 3)
    # one sequence writes 10 + 6 = 16 tokens = 4 pages; 2 are shared: 2 + 3 x 2 = 8
    assert leader.count.total == 8
    group = leader.group
    assert group is not None and group.shared == 2
    engine.step()  # admitted: every sequence has its pages; the leader prefills
    sibling = group.siblings[0]
    assert leader.status is Status.RUNNING and sibling.status is Status.RUNNING
    assert sibling.pages["main"][:2] == leader.pages["main"][:2]
    assert sibling.pages["main"][2] != leader.pages["main"][2]
    for page in leader.pages["main"][:2]:
        assert engine.kv.pool.refcount[page] == 1  # the group holds them once
    assert group_held(leader) == 2 + 3 * 1
    assert steps[-1] == {"g": 10}  # the others wait for the shared pages
    engine.step()
    assert steps[-1] == {"g/1": 2, "g/2": 2}  # their own prompt positions; the leader waits
    engine.step()
    assert steps[-1] == {"g": 1, "g/1": 1, "g/2": 1}  # then all decode at once
    most = 0
    while engine.has_work():
        most = max(most, group_held(leader))
        engine.step()
    assert most == leader.count.total
    assert [len(seq.output) for seq in group.sequences] == [6, 6, 6]
    assert engine.kv.free + engine.kv.evictable == 63
    assert engine.backend is not None and engine.backend.outstanding() == 0


def test_the_group_waits_whole_until_its_count_fits() -> None:
    engine, _ = make_engine(12)  # 11 usable pages
    engine.add_request("solo", list(range(20, 30)), 6)  # 4 pages, held to the end
    engine.step()
    leader = add_group(engine, "g", 3)  # 8 pages: 4 + 8 > 11, though the leader's 4 fit
    for _ in range(3):
        engine.step()
        assert leader.status is Status.WAITING
        assert all(s.status is Status.WAITING for s in leader.group.siblings)
    finished, _ = drain(engine)
    assert set(finished) == {"solo", "g", "g/1", "g/2"}


def test_a_group_the_pool_can_never_hold_is_refused_naming_n() -> None:
    engine, _ = make_engine(8)  # 7 usable pages: two sequences (6) fit, three (8) do not
    with pytest.raises(RequestRejected) as raised:
        add_group(engine, "g", 3)
    assert raised.value.param == "n"
    assert "lower n to at most 2" in str(raised.value)
    assert not engine.has_work()
    add_group(engine, "g", 2)


def test_sibling_ids_must_be_new() -> None:
    engine, _ = make_engine(64)
    engine.add_request("a", PROMPT, 4)
    with pytest.raises(RequestRejected, match="'a' is already in use"):
        engine.add_request("b", PROMPT, 4, siblings=[("a", SamplingParams())])
    with pytest.raises(RequestRejected, match="'c' is already in use"):
        engine.add_request("c", PROMPT, 4, siblings=[("c", SamplingParams())])
    assert engine.num_waiting == 1


def test_a_sequence_that_stops_returns_its_own_pages_at_once() -> None:
    engine, runner = make_engine(64)
    runner.stop_after("g/1", 2)
    leader = add_group(engine, "g", 3)
    seen = False
    while engine.has_work():
        before = engine.kv.free
        outs = {out.rid: out for out in engine.step()}
        if "g/1" in outs and outs["g/1"].finished:
            assert outs["g/1"].finish_reason is FinishReason.STOP
            assert leader.group.siblings[0].held == 0
            assert engine.kv.free >= before  # its own pages went back
            assert "g" in engine.sched.running  # the group runs on
            seen = True
    assert seen


def test_aborting_one_sequence_leaves_the_others_running() -> None:
    engine, _ = make_engine(64)
    leader = add_group(engine, "g", 3)
    for _ in range(3):
        engine.step()
    assert engine.abort("g/2")
    assert not engine.abort("g/2")  # already finished
    finished, _ = drain(engine)
    assert finished["g/2"].finish_reason is FinishReason.ABORT
    assert finished["g"].finish_reason is FinishReason.LENGTH
    assert leader.status is Status.FINISHED


def test_the_leader_ending_first_keeps_the_shared_pages_for_the_others() -> None:
    engine, runner = make_engine(64)
    runner.stop_after("g", 1)
    leader = add_group(engine, "g", 2)
    finished, _ = drain(engine)
    assert finished["g"].finish_reason is FinishReason.STOP
    assert finished["g/1"].finish_reason is FinishReason.LENGTH
    assert leader.status is Status.FINISHED
    assert engine.kv.free + engine.kv.evictable == 63


def test_aborting_the_waiting_leader_ends_every_sequence() -> None:
    engine, _ = make_engine(12)
    engine.add_request("solo", list(range(20, 30)), 6)
    engine.step()
    add_group(engine, "g", 3)
    engine.step()
    assert engine.abort("g")
    outs = {out.rid: out for out in engine.step()}
    assert {rid for rid, out in outs.items() if out.finished} >= {"g", "g/1", "g/2"}
    assert all(outs[r].finish_reason is FinishReason.ABORT for r in ("g", "g/1", "g/2"))
    drain(engine)
    # the ids are free again
    add_group(engine, "g", 3)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_groups_beside_lone_requests(policy: str) -> None:
    engine, runner = make_engine(30, policy, max_batch_tokens=16)
    runner.stop_after("b/1", 3)
    add_group(engine, "a", 3)
    engine.add_request("solo", list(range(40, 52)), 8)
    add_group(engine, "b", 2, max_tokens=8, prompt=list(range(1, 9)))  # page-aligned prompt
    add_group(engine, "c", 4, max_tokens=3, prompt=[7, 8, 9])  # shares nothing
    finished, _ = drain(engine)
    expected = {"a", "a/1", "a/2", "solo", "b", "b/1", "c", "c/1", "c/2", "c/3"}
    assert set(finished) == expected
    assert engine.kv.free + engine.kv.evictable == 29
    assert not engine.sched.running


def test_a_preempted_group_resumes_whole() -> None:
    engine, _ = make_engine(12, "preempt")  # 11 usable pages
    engine.add_request("solo", list(range(40, 50)), 8)  # 5 pages at the end
    leader = add_group(engine, "g", 3, max_tokens=8)  # 2 + 3 x 3 = 11: the latest, preempted
    finished, _ = drain(engine)
    assert leader.preemptions > 0
    assert set(finished) == {"g", "g/1", "g/2", "solo"}
    assert engine.sched.stats.preemptions > 0
    assert all(out.finish_reason is FinishReason.LENGTH for out in finished.values())


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["banker", "peak", "peak+backfill", "preempt", "ratio"]),
    page=st.sampled_from([2, 4]),
    jobs=st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 8), st.integers(1, 4), st.integers(0, 8)),
        min_size=1,
        max_size=6,
    ),
)
def test_no_group_ever_holds_more_than_its_count(
    policy: str, page: int, jobs: list[tuple[int, int, int, int]]
) -> None:
    """Random groups (prompt length, max_tokens, n, when one sequence stops) under pressure: at
    every step, as the rows run, each group holds at most its count; one that runs to the end
    holds exactly what its last rows write (the count of max_tokens - 1: the last token
    sampled is never written)."""
    model = tiny_model(page_size=page)
    engine, runner = make_engine(48, policy, model=model, max_batch_tokens=24)
    leaders: list[Request] = []
    most: dict[str, int] = {}
    run = runner.run

    def measuring(batch):  # type: ignore[no-untyped-def]
        for leader in leaders:
            if leader.status is Status.RUNNING:
                held = groups.held(leader)
                assert held <= leader.count.total
                most[leader.rid] = max(most.get(leader.rid, 0), held)
        return run(batch)

    runner.run = measuring  # type: ignore[method-assign]
    for i, (prompt, max_tokens, n, stop) in enumerate(jobs):
        if stop and n > 1:
            runner.stop_after(f"r{i}/1", stop)
        leaders.append(add_group(engine, f"r{i}", n, max_tokens, list(range(i, i + prompt))))
    drain(engine)
    assert not engine.has_work()
    assert engine.kv.free + engine.kv.evictable == 47
    for (_, max_tokens, n, stop), leader in zip(jobs, leaders, strict=True):
        if (stop and n > 1) or leader.preemptions:
            continue
        written = count_pages(model, replace(leader.shape, max_tokens=max_tokens - 1))
        assert most[leader.rid] == written.total


@pytest.mark.parametrize("policy", ["banker", "peak+backfill"])
def test_a_group_whose_prompt_comes_back_from_host_reloads_it_once_for_all(policy: str) -> None:
    engine, _ = make_engine(14, policy, host_pages=16)  # 13 usable pages
    add_group(engine, "first", 2, max_tokens=2)
    drain(engine)
    for i in range(3):  # other prompts push the first's cached pages out to host
        engine.add_request(f"other{i}", list(range(50 + 20 * i, 70 + 20 * i)), 6)
        drain(engine)
    host = engine.kv.host
    assert host is not None and host.saved > 0
    loaded = host.loaded
    steps = record_rows(engine)
    leader = add_group(engine, "again", 3, max_tokens=4)
    finished, _ = drain(engine)
    assert {"again", "again/1", "again/2"} <= set(finished)
    assert host.loaded - loaded == 2  # the two shared prompt pages, copied back once
    assert steps[0]["again"] == 2  # only the last prompt page is computed
    assert [len(seq.output) for seq in leader.group.sequences] == [4, 4, 4]
