"""`kvbank bench --replicas N --router R`: the cluster bench as a user runs it, and its routers
on real engines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvbank.cli import main
from kvbank.engine.bench.cluster import run_cluster
from kvbank.engine.bench.replica import Replica
from kvbank.engine.bench.routers import KvbankRouter, LeastKv, Placed
from kvbank.engine.bench.scenario import ScenarioError, parse_scenario
from kvbank.engine.bench.workload import RequestSpec, generate
from kvbank.picker import Pick, Shed
from kvbank.picker.prefix import prompt_blocks

TINY = """
name: tiny-cluster
replicas: 2
pool: {pages: 64, page_size: 4}
model:
  kv_slots: {main: {prompt: 1, output: 1}}
  max_seq_len: 128
  max_tokens_default: 32
  speculative_tokens: 1
cost_model: {step_base_ms: 8, prefill_ms_per_token: 0.02, decode_ms_per_row: 0.05,
             attn_ms_per_page: 0.002}
time_limit_s: 120
workload:
  rate_per_s: 6
  burst: {min: 1, max: 4}
  requests: 36
  seed: 7
  classes:
    - {name: chat, weight: 2, prompt_tokens: {min: 8, max: 40}, shared_prefix: sys,
       shared_prefix_tokens: 8, max_tokens: 24, output_tokens: {min: 2, max: 20},
       slo: {ttft_s: 1.0}}
    - {name: batch, weight: 1, service_class: best-effort, prompt_tokens: {min: 20, max: 60},
       max_tokens: 32, output_tokens: {min: 4, max: 30}}
"""


def write(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def bench_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_router_reports_the_pool_and_each_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = bench_json(capsys, "--scenario", str(write(tmp_path)), "--router", "all")
    assert [r["router"] for r in runs] == ["round-robin", "least-kv", "kvbank"]
    for run in runs:
        assert run["replicas"] == 2 and run["policy"] == "peak+backfill"
        assert run["stopped"] == "finished" and run["hung"] == 0
        assert run["invariant_breaches"] == 0 and run["strict_preemptions"] == 0
        for key in ("goodput_per_s", "strict_ttft_p99_s", "routed_then_waited", "wait_p99_s"):
            assert key in run
        replicas = run["per_replica"]
        assert [r["replica"] for r in replicas] == [0, 1]
        assert sum(r["sent"] for r in replicas) + run["shed"] == 36
        assert sum(r["completed"] for r in replicas) == run["completed"]
        assert all(r["invariant_breaches"] == 0 and r["strict_preemptions"] == 0 for r in replicas)
    assert runs[0]["per_replica"][0]["sent"] == 18  # round-robin alternates


def test_a_run_is_deterministic_and_the_table_compares_kvbank_with_least_kv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(write(tmp_path))
    first = bench_json(capsys, "--scenario", path, "--router", "kvbank", "--replicas", "3")
    again = bench_json(capsys, "--scenario", path, "--router", "kvbank", "--replicas", "3")
    assert first == again and first[0]["replicas"] == 3
    assert main(["bench", "--scenario", path, "--router", "least-kv,kvbank"]) == 0
    table = capsys.readouterr().out
    assert "kvbank / least-kv, same run: strict TTFT p99" in table
    assert "per replica:" in table and "| least-kv" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--router", "random"], "unknown --router 'random'"),
        (["--policy", "preempt"], "runs one of kvbank's ledger policies"),
        (["--replicas", "0"], "--replicas must be at least 1, got 0"),
        (["--scrape-ms", "-5"], "--scrape-ms must be at least 0"),
        (["--max-hold-s", "-1"], "--max-hold-s must be at least 0 (0 holds nothing)"),
        (["--max-hold-s", "nan"], "--max-hold-s must be at least 0"),
    ],
)
def test_a_bad_flag_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["bench", "--scenario", str(write(tmp_path)), *argv]) == 2
    assert message in capsys.readouterr().err


def test_scenario_fields_for_the_cluster() -> None:
    with pytest.raises(ScenarioError, match="replicas: must be at least 1, got 0"):
        parse_scenario(_data(TINY.replace("replicas: 2", "replicas: 0")))
    closed = TINY.replace("  rate_per_s: 6\n", "  concurrency: 4\n")
    with pytest.raises(ScenarioError, match="workload.burst: bursts are open loop"):
        parse_scenario(_data(closed))
    specs = list(generate(parse_scenario(_data(TINY)).workload))
    times = [s.arrival_s for s in specs]
    assert len(set(times)) < len(times)  # some arrive together
    assert times == sorted(times)


def _data(text: str) -> dict:
    return yaml.safe_load(text)


def _spec(rid: str, prompt: list[int], max_tokens: int = 24) -> RequestSpec:
    cls = parse_scenario(_data(TINY)).workload.classes[0]
    return RequestSpec(rid, replace(cls, max_tokens=max_tokens), prompt, 4, 0.0)


def filled(replicas: int) -> list[Replica]:
    """Replicas of TINY, each running two requests of 31 pages: 1 of its 63 usable is left."""
    scenario = parse_scenario(_data(TINY))
    pool = [Replica(scenario, "peak+backfill") for _ in range(replicas)]
    for r, replica in enumerate(pool):
        for i in range(2):
            first = 2 + 100 * i + 300 * r
            replica.send(_spec(f"big{r}{i}", list(range(first, first + 88)), 32))
        replica.step()
    return pool


class TestLeastKv:
    def test_its_metrics_lag_by_the_scrape_interval(self) -> None:
        scenario = parse_scenario(_data(TINY))
        pool = [Replica(scenario, "peak+backfill") for _ in range(2)]
        router = LeastKv(pool, scrape_s=0.05, seed=1)
        router.route(_spec("a", list(range(10, 30))), 0.0)
        pool[0].send(_spec("a", list(range(10, 30))), 0.0)
        router.route(_spec("b", list(range(40, 60))), 0.04)
        assert router._queues == [0, 0]  # the queued request is not seen yet
        router.route(_spec("c", list(range(70, 90))), 0.05)
        assert router._queues == [1, 0]

    def test_the_prefix_scorer_sends_a_prompt_back_where_it_went(self) -> None:
        scenario = parse_scenario(_data(TINY))
        pool = [Replica(scenario, "peak+backfill") for _ in range(4)]
        router = LeastKv(pool, scrape_s=0.05, seed=1)
        prompt = list(range(100, 140))
        first = router.route(_spec("a", prompt), 0.0)
        assert all(router.route(_spec(f"r{i}", prompt), 0.0) == first for i in range(5))
        assert len(prompt_blocks(prompt, 4)) == 10


class TestKvbankRouter:
    def test_a_strict_request_goes_where_the_ledger_admits_it_now(self) -> None:
        scenario = parse_scenario(_data(TINY))
        pool = [Replica(scenario, "peak+backfill") for _ in range(2)]
        router = KvbankRouter(pool, max_hold_s=0)
        big = _spec("big", list(range(2, 90)), max_tokens=32)  # 31 of 63 usable pages
        pool[0].send(big)
        pool[0].step()
        assert pool[0].engine.num_running == 1
        assert router.route(_spec("next", list(range(200, 290)), 32), 0.0) == Pick("1")

    def test_best_effort_queues_on_a_busy_pod_and_is_shed_once_the_backlog_is_a_pool(self) -> None:
        pool = filled(1)
        router = KvbankRouter(pool, max_hold_s=0)
        batch = pool[0].scenario.workload.classes[1]
        policy = pool[0].engine.policy
        queued = 0
        while True:
            first = 1000 + 100 * queued
            spec = RequestSpec(f"be{queued}", batch, list(range(first, first + 60)), 4, 0.0)
            answer = router.route(spec, 0.0)
            if isinstance(answer, Shed):
                break
            # No room now (the strict requests hold the pool): it waits in the pod's queue.
            assert answer == Pick("0", waits=True)
            pool[0].send(spec, 0.0)
            queued += 1
            assert queued < 64, "never shed"
        # Shed once what waits to start there and it would not fit the pool.
        need = router.count(spec).pages_to_start
        assert queued >= 2 and policy.best_effort.backlog_pages + need > 63
        assert "backlog of at least" in answer.message

    def test_a_strict_request_no_replica_admits_is_held_until_one_does(self) -> None:
        pool = filled(2)
        router = KvbankRouter(pool, max_hold_s=10)
        held = _spec("held", list(range(700, 790)), 32)
        assert router.route(held, 0.5) is None
        assert router.release(0.5) == []
        # 11 pages, still growing when the running requests reach their 62: no replica admits it.
        behind = _spec("behind", list(range(800, 810)), 32)
        assert router.route(behind, 0.6) is None and router.release(0.6) == []
        placed: list[Placed] = []
        while not placed:  # only replica 1 makes progress: its requests finish first
            assert pool[1].step()
            placed = router.release(1.0)
        # The head goes first, to the replica that freed room, counted from its arrival.
        assert placed == [Placed(held, Pick("1"), 0.5)]

    def test_a_short_request_passes_to_where_the_room_curve_admits_it_now(self) -> None:
        pool = filled(2)
        router = KvbankRouter(pool, max_hold_s=10)
        held = _spec("held", list(range(700, 790)), 32)
        assert router.route(held, 0.5) is None and router.release(0.5) == []
        # 5 pages at worst, over the 1 page of headroom, but gone by step 8, long before the
        # running requests reach their peak: the peak-fit ledger admits it beside them.
        short = _spec("short", list(range(800, 810)), 8)
        assert router.route(short, 0.6) is None
        [placed] = router.release(0.6)
        assert placed.spec is short and isinstance(placed.answer, Pick)
        assert not placed.answer.waits and placed.answer.pod != router.lobby.claim("held")
        replica = pool[int(placed.answer.pod)]
        assert replica.send(short, 0.6)
        replica.step()
        assert "short" in replica.engine.sched.running  # as the curve said

    def test_past_max_hold_a_held_request_queues_where_it_starts_soonest(self) -> None:
        pool = filled(1)
        router = KvbankRouter(pool, max_hold_s=2)
        held = _spec("held", list(range(700, 790)), 32)
        assert router.route(held, 0.0) is None and router.release(1.9) == []
        assert router.release(2.0) == [Placed(held, Pick("0", waits=True), 0.0)]


def test_a_held_request_is_sent_with_its_arrival_time_so_its_ttft_counts_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scenario = parse_scenario(_data(TINY.replace("rate_per_s: 6", "rate_per_s: 40")))
    sent: dict[str, float | None] = {}
    send = Replica.send

    def recording(self: Replica, spec: RequestSpec, now: float | None = None) -> bool:
        sent[spec.rid] = now
        return send(self, spec, now)

    monkeypatch.setattr(Replica, "send", recording)
    result = run_cluster(scenario, "kvbank", 2, "peak+backfill", 0.05, max_hold_s=10)
    assert result.metrics["held_by_router"] > 0 and result.metrics["hung"] == 0
    arrivals = {s.rid: s.arrival_s for s in generate(scenario.workload)}
    assert sent and all(now == arrivals[rid] for rid, now in sent.items())
