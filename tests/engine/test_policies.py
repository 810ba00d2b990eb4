"""Every admission policy through the same engine, on small versions of the scenarios."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvbank.capacity import SINK_PAGES, RequestShape, count_pages
from kvbank.engine.admission.policy import policy_names
from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.simulate import run_policy

# The benchmark scenarios the README's `kvbank bench` runs.
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def scenario(name: str) -> Scenario:
    return load_scenario(SCENARIOS / f"{name}.yaml")


def shrink(s: Scenario, requests: int, concurrency: int | None = None) -> Scenario:
    workload = replace(s.workload, requests=requests)
    if concurrency is not None:
        workload = replace(workload, concurrency=concurrency)
    return replace(s, workload=workload)


def test_seed_repro_banker_runs_exactly_what_the_pool_holds_with_the_prefix_leased() -> None:
    s = scenario("shared-prefix")
    cls = s.workload.classes[0]
    prompt, max_tokens = cls.prompt_tokens.low, cls.max_tokens
    worst = count_pages(s.model, RequestShape(prompt, max_tokens)).total  # 70 pages
    shared = (prompt - 1) // s.model.page_size  # 58 full pages leased; the last is recomputed
    at_once = (s.pages - SINK_PAGES - shared) // (worst - shared)
    assert (worst, shared, at_once) == (70, 58, 3)
    m = run_policy(s, "banker", debug=True).metrics
    assert m["max_running"] == at_once
    assert (m["completed"], m["hung"], m["preemptions"], m["invariant_breaches"]) == (32, 0, 0, 0)


def test_optimistic_deadlocks_on_the_seed_repro_and_the_driver_stops_it() -> None:
    m = run_policy(scenario("shared-prefix"), "optimistic").metrics
    assert m["completed"] < 32 and m["hung"] == 32 - m["completed"]
    assert m["stopped"].startswith("deadlock")
    assert m["duration_s"] < 40  # stopped after 30 s without a token, not at the 600 s limit
    assert m["invariant_breaches"] == 0


@pytest.mark.parametrize("policy", ["banker", "optimistic", "preempt", "no-evict", "ratio"])
@pytest.mark.parametrize(
    ("name", "requests", "concurrency"),
    [("shared-prefix", 12, 12), ("image-chat-stress", 16, 8), ("speech-tp2", 12, 8)],
)
def test_every_policy_on_small_scenarios(
    policy: str, name: str, requests: int, concurrency: int
) -> None:
    s = shrink(scenario(name), requests, concurrency)
    m = run_policy(s, policy, debug=True).metrics
    assert m["invariant_breaches"] == 0, m["stopped"]
    assert m["completed"] + m["hung"] + m["rejected"] + m["failed"] == requests
    if policy in ("banker", "no-evict", "preempt", "ratio"):
        assert (m["completed"], m["hung"]) == (requests, 0), m["stopped"]
    if policy in ("banker", "no-evict"):
        assert m["preemptions"] == 0


def test_banker_never_preempts_and_finishes_every_holdable_request_on_image_chat() -> None:
    m = run_policy(shrink(scenario("image-chat-stress"), 40), "banker").metrics
    assert (m["completed"], m["hung"], m["preemptions"], m["invariant_breaches"]) == (40, 0, 0, 0)


def test_preempt_preempts_and_ratio_retracts_where_optimistic_would_stall() -> None:
    s = shrink(scenario("shared-prefix"), 32)
    assert run_policy(s, "preempt").metrics["preemptions"] > 0
    assert run_policy(s, "ratio").metrics["preemptions"] > 0


def test_the_policy_list_starts_with_banker_and_holds_the_baselines() -> None:
    assert policy_names()[:5] == ["banker", "optimistic", "preempt", "no-evict", "ratio"]


def test_kvshare_hit_rate_is_counted() -> None:
    m = run_policy(shrink(scenario("kvshare"), 30, 12), "banker").metrics
    assert m["prefix_hit_rate"] > 0.5 and m["hung"] == 0
