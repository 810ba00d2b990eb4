"""Strict and best-effort requests in one vLLM pool under kvbank's admission (kvbank.vllm.classes):
under KV pressure no strict request is preempted, best-effort ones are, every request finishes,
and one preempted `max_preemptions` times is promoted and never preempted again; under vLLM's
FCFS and priority policies, stepped synchronously and as async scheduling steps it."""

from __future__ import annotations

import time

import grpc
import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from vllm_builders import MODES, _configs, bench, drive, pressure, scenario

from kvbank.engine.bench.vllm_engine import FinishReason
from kvbank.engine.bench.vllm_simulate import run_vllm_policy
from kvbank.ledger import InvariantBreach
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.service_class import ServiceClass
from kvbank.sidecar.auth import bearer
from kvbank.vllm.classes import Classes
from kvbank.vllm.scheduler import make_backend
from kvbank.vllm.settings import Settings, SettingsError, from_env

pytestmark = pytest.mark.timeout(300)
POLICIES = ("banker", "peak+backfill")


def _classes_at_arrival(run, seen: dict[str, bool]) -> None:  # type: ignore[no-untyped-def]
    """Note each new request's class (a promoted one is strict later): True for strict."""
    for rid in run.sched.requests:
        seen.setdefault(rid, rid not in run.sched.kvbank.classes.best_effort)


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_under_pressure_only_best_effort_requests_are_preempted_and_all_finish(
    policy: str, mode: str, scheduling: str
) -> None:
    settings = Settings(policy, max_preemptions=2)
    run = bench(48, policy, async_scheduling=MODES[mode], scheduling=scheduling, settings=settings)
    classes = run.sched.kvbank.classes
    arrived: dict[str, bool] = {}
    seen = drive(run, pressure(scheduling), on_step=lambda: _classes_at_arrival(run, arrived))
    strict = {rid for rid, is_strict in arrived.items() if is_strict}
    assert strict == {f"s{i}" for i in range(5)}  # the tier decides first, then the priority
    assert run.sched.kvbank.preemptions == 0
    assert not set(seen.preempted) & {f"s{i}" for i in range(5)}
    assert seen.preemptions > 0  # best-effort requests were preempted
    assert classes.promoted > 0
    assert all(n <= settings.max_preemptions for n in seen.preempted.values())  # then strict
    assert set(seen.finished) == {*(f"be{i}" for i in range(4)), *strict}
    assert set(seen.finished.values()) == {FinishReason.STOP}  # at the workload's length
    assert seen.tokens == {rid: 400 if rid.startswith("be") else 128 for rid in seen.finished}
    assert not run.sched.requests
    assert run.sched.kvbank.backend.outstanding() == 0
    assert run.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 47


@pytest.mark.parametrize("mode", MODES)
def test_with_no_preemption_allowed_a_best_effort_request_is_promoted_at_its_first(
    mode: str,
) -> None:
    run = bench(48, "peak+backfill", async_scheduling=MODES[mode], settings=Settings(
        "peak+backfill", max_preemptions=0))  # fmt: skip
    seen = drive(run, pressure("fcfs"))
    assert seen.preempted and set(seen.preempted.values()) == {1}
    assert run.sched.kvbank.classes.promoted == len(seen.preempted)
    assert run.sched.kvbank.preemptions == 0
    assert len(seen.finished) == 9


def _request(rid: str, tier: object = None, priority: int = 0) -> Request:
    extra = {"service_tier": tier} if tier is not None else None
    params = SamplingParams(max_tokens=8, extra_args=extra)
    return Request(rid, [1, 2, 3], params, None, priority=priority)


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_a_request_class_is_its_tier_then_its_priority_then_the_default(scheduling: str) -> None:
    sched = bench(64, "banker", scheduling=scheduling).sched
    for default in ServiceClass:
        classes = Classes(sched, sched.kvbank.tables, Settings(default_class=default))
        assert classes.class_of(_request("a", "flex")) is ServiceClass.BEST_EFFORT
        assert classes.class_of(_request("b", "priority", 7)) is ServiceClass.STRICT
        for tier in (None, "auto", "default"):
            late = classes.class_of(_request("c", tier, 1))
            assert late is (ServiceClass.BEST_EFFORT if scheduling == "priority" else default)
            assert classes.class_of(_request("d", tier, 0)) is default


def test_a_tier_no_class_has_is_refused_with_the_tiers() -> None:
    run = bench(64, "banker")
    seen = drive(run, {0: [("odd", [3] * 32, 8, 8, "scale"), ("ok", [4] * 32, 8, 8, "flex")]})
    assert seen.finished == {"odd": FinishReason.ERROR, "ok": FinishReason.STOP}


def test_under_the_priority_policy_every_best_effort_request_sorts_after_every_strict_one() -> None:
    run = bench(64, "banker", scheduling="priority")
    run.add("flex-first", [5] * 32, 8, 8, "flex", -3)
    run.add("strict-late", [6] * 32, 8, 8, "priority", 40)
    strict, best_effort = run.sched.requests["strict-late"], run.sched.requests["flex-first"]
    assert (strict.priority, best_effort.priority) == (0, 1)  # threshold 1: below, at
    assert strict < best_effort  # vLLM's queue order; its victim is the largest


SHARED = [9] * 160  # ten full blocks


def _hit_held_by_best_effort() -> dict[int, list[tuple]]:
    """A best-effort request holds ten blocks a strict one's prompt starts with. The strict
    request `t` holds a reservation of 20 pages; `s` (35 pages, 10 of them the shared prefix)
    fits the 47 the pool has only if the prefix counted as free."""
    return {
        0: [("be", SHARED, 300, 300, "flex"), ("t", [4] * 16, 304, 304)],
        3: [("s", [*SHARED, *([8] * 16)], 384, 384)],
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_a_strict_hit_on_blocks_only_best_effort_requests_hold_costs_their_pages(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = bench(48, policy, max_seq_len=640)
    seen = drive(run, _hit_held_by_best_effort())
    assert run.sched.kvbank.preemptions == 0
    assert set(seen.finished) == {"be", "t", "s"}
    # The same run with the hit credited by vLLM's reference count (the best-effort holder
    # counted as a strict one): the prefix is counted free twice, and the ledger overcommits.
    monkeypatch.setattr(Classes, "strict_holders", lambda self: lambda block: block.ref_cnt)
    with pytest.raises(InvariantBreach):
        drive(bench(48, policy, max_seq_len=640), _hit_held_by_best_effort())


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("KVBANK_DEFAULT_CLASS", "gold", "strict, best-effort"),
        ("KVBANK_MAX_PREEMPTIONS", "-1", "0 or more"),
        ("KVBANK_MAX_PREEMPTIONS", "two", "not an integer"),
        ("KVBANK_BEST_EFFORT_PRIORITY", "1.5", "not an integer"),
    ],
)
def test_a_bad_class_setting_is_refused_naming_the_variable(
    variable: str, value: str, says: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        from_env({variable: value})
    assert refused.value.variable == variable
    assert says in str(refused.value)


def test_the_class_settings_are_read_from_the_environment() -> None:
    got = from_env(
        {
            "KVBANK_DEFAULT_CLASS": "best-effort",
            "KVBANK_MAX_PREEMPTIONS": "5",
            "KVBANK_BEST_EFFORT_PRIORITY": "-2",
        }
    )
    assert (got.default_class, got.max_preemptions, got.best_effort_priority) == (
        ServiceClass.BEST_EFFORT, 5, -2)  # fmt: skip
    assert from_env({}) == Settings()


def test_the_default_class_best_effort_runs_a_request_that_names_no_tier_best_effort() -> None:
    settings = Settings("banker", default_class=ServiceClass.BEST_EFFORT)
    vllm_config = _configs(48, 512)[0]
    assert vllm_config.scheduler_config.policy == "fcfs"
    run = bench(48, "banker", settings=settings)
    run.add("plain", [3] * 32, 8, 8)
    run.add("asked", [4] * 32, 8, 8, "priority")
    assert set(run.sched.kvbank.classes.best_effort) == {"plain"}


MIXED = {
    "concurrency": 8,
    "requests": 24,
    "classes": [
        {"name": "chat", "weight": 1, "prompt_tokens": 96, "max_tokens": 96, "output_tokens": 96},
        {
            "name": "batch",
            "weight": 1,
            "service_class": "best-effort",
            "prompt_tokens": 64,
            "max_tokens": 320,
            "output_tokens": 320,
        },
    ],
}


@pytest.mark.parametrize("mode", MODES)
def test_the_vllm_bench_gives_each_request_its_class(mode: str) -> None:
    case = scenario(48, **MIXED)
    for policy in ("vllm+banker", "vllm+peak+backfill"):
        got = run_vllm_policy(case, policy, debug=True, async_scheduling=MODES[mode]).metrics
        assert got["admitted_as"] == {"chat": "strict", "batch": "best-effort"}
        assert got["preemptions_by_class"]["chat"] == 0, policy
        assert got["preemptions_by_class"]["batch"] > 0, policy
        assert (got["completed"], got["hung"], got["invariant_breaches"]) == (24, 0, 0), policy


def _routing_figures(sidecar: str) -> pb.RoutingFigures:
    """The sidecar's figures as a picker watches them (sidecar/routing.py), with its token."""
    with grpc.insecure_channel(sidecar) as channel:
        stream = pb_grpc.RoutingStub(channel).Watch(
            pb.WatchRequest(watcher_id="test"), metadata=bearer("vllm-property")
        )
        try:
            return next(stream)
        finally:
            stream.cancel()


def test_over_a_served_sidecar_best_effort_work_leaves_the_pickers_room(sidecar: str) -> None:
    """vLLM over a sidecar it never waits on (as a pod runs it) tells pickers about its
    best-effort requests, which the ledger never hears of: the blocks only they hold leave the
    best-effort room, and what the waiting ones need to start is the backlog; both go once
    they finish."""
    settings = Settings("peak+backfill", sidecar, token="vllm-property", blocking=False)
    backend = make_backend(settings, 48, 16, 0, engine_id="classes-figures")
    run = bench(48, "peak+backfill", backend=backend, settings=settings)
    for i in range(6):  # more long best-effort requests than the 48 blocks run at once
        run.add(f"be{i}", [50 + i] * 64, 400, 400, "flex")
    busy = None
    for _ in range(400):
        run.step()
        time.sleep(0.002)  # the model's forward pass: the sidecar's replies arrive meanwhile
        figures = _routing_figures(sidecar)
        if figures.best_effort_backlog_pages and run.sched.kvbank.classes.reclaimable():
            busy = figures
            break
    assert busy is not None, "the sidecar never heard of the best-effort work"
    assert busy.headroom_pages > 0  # the ledger counts their blocks as reclaimable supply
    assert busy.best_effort_room_pages < busy.headroom_pages - busy.best_effort_backlog_pages
    drive(run, {}, pause_s=0.001)
    run.step()  # one more report: the figures as the pool ends
    time.sleep(0.2)
    done = _routing_figures(sidecar)
    assert done.best_effort_backlog_pages == 0
    assert done.best_effort_room_pages == done.headroom_pages
