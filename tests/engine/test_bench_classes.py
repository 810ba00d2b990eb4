"""Scenario fields for service classes, SLOs and the host tier, and the per-class figures of
`kvbank bench --json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbank.cli import main
from kvbank.engine.bench.outcomes import Outcome
from kvbank.engine.bench.scenario import (
    RequestClass,
    ScenarioError,
    ServiceClass,
    Slo,
    Span,
    load_scenario,
    parse_scenario,
)
from kvbank.engine.request import make_request
from tests.engine.engine_builders import tiny_model

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"

MIXED = """
name: mixed
pool: {pages: 48, page_size: 4, host_pages: 32}
model:
  kv_slots: {main: {prompt: 1, output: 1}}
  max_seq_len: 128
  max_tokens_default: 32
cost_model: {host_ms_per_page: 0.08}
workload:
  concurrency: 6
  requests: 24
  seed: 5
  classes:
    - {name: voice, weight: 1, service_class: strict, prompt_tokens: {min: 4, max: 12},
       max_tokens: 24, output_tokens: {min: 8, max: 24}, slo: {ttft_s: 1.0, tpot_s: 0.05}}
    - {name: batch, weight: 2, service_class: best-effort, prompt_tokens: {min: 8, max: 40},
       output_tokens: {min: 4, max: 30}, slo: {ttft_s: 30}}
    - {name: plain, weight: 1, prompt_tokens: 6, output_tokens: 5}
"""


def test_the_shared_class_scenarios_load() -> None:
    voice = load_scenario(SCENARIOS / "voice-and-batch.yaml")
    assert voice.host_pages == 4096
    assert voice.cost.host_ms_per_page == 0.08
    by_name = {c.name: c for c in voice.workload.classes}
    assert by_name["voice"].service_class is ServiceClass.STRICT
    assert by_name["voice"].slo == Slo(ttft_s=1.0, tpot_s=0.05)
    assert by_name["batch"].service_class is ServiceClass.BEST_EFFORT
    chat = load_scenario(SCENARIOS / "chat-best-effort.yaml")
    assert chat.host_pages == 2048
    assert [c.service_class for c in chat.workload.classes] == [ServiceClass.BEST_EFFORT]


def test_defaults_leave_a_scenario_strict_without_host_tier() -> None:
    scenario = parse_scenario(__import__("yaml").safe_load(MIXED))
    plain = scenario.workload.classes[2]
    assert plain.service_class is ServiceClass.STRICT and plain.slo is None
    bare = load_scenario(SCENARIOS / "shared-prefix.yaml")
    assert bare.host_pages == 0 and bare.cost.host_ms_per_page == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("service_class: best-effort", "service_class: gold"),
         "workload.classes[1].service_class: must be one of strict, best-effort, got 'gold'"),
        (("slo: {ttft_s: 30}", "slo: {ttft_s: -2}"),
         "workload.classes[1].slo.ttft_s: must be greater than 0, got -2"),
        (("slo: {ttft_s: 30}", "slo: {ttft: 30}"),
         "workload.classes[1].slo.ttft: unknown field; allowed: tpot_s, ttft_s"),
        (("slo: {ttft_s: 30}", "slo: {}"),
         "workload.classes[1].slo: set ttft_s, tpot_s or both"),
        (("slo: {ttft_s: 30}", "slo: fast"), "workload.classes[1].slo: must be a mapping"),
        (("host_pages: 32", "host_pages: -1"), "pool.host_pages: must be at least 0, got -1"),
        (("host_pages: 32", "host_pages: lots"), "pool.host_pages: must be an integer"),
        (("{host_ms_per_page: 0.08}", "{host_ms_per_page: -0.5}"),
         "cost_model.host_ms_per_page: must be at least 0, got -0.5"),
        (("output_tokens: {min: 4, max: 30},", "output_tokens: 4, fixed_label_tokens: {main: 8},"),
         "workload.classes[1].service_class: a class with fixed_label_tokens"),
    ],
)  # fmt: skip
def test_a_bad_class_field_names_the_field_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: tuple[str, str], message: str
) -> None:
    assert change[0] in MIXED
    path = tmp_path / "scenario.yaml"
    path.write_text(MIXED.replace(change[0], change[1]))
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert any(p.startswith(message) for p in caught.value.problems), caught.value.problems
    assert main(["bench", "--scenario", str(path)]) == 2
    assert message in capsys.readouterr().err


def _outcome(slo: Slo | None = None) -> Outcome:
    cls = RequestClass("c", 1.0, Span(4, 4), Span(4, 4), 8, slo=slo)
    return Outcome(cls, make_request(tiny_model(), "r", [5, 6, 7, 8]), sent_s=1.0)


def test_an_outcome_counts_tpot_the_longest_stall_and_recomputed_positions() -> None:
    outcome = _outcome(Slo(ttft_s=0.5, tpot_s=0.2))
    outcome.on_row(0, 4)  # the prompt
    outcome.on_tokens(1, 1.25)
    outcome.on_row(4, 1)
    outcome.on_tokens(1, 1.5)
    outcome.on_row(0, 5)  # preempted, readmitted: all five positions again
    outcome.on_row(5, 1)
    outcome.on_tokens(1, 2.5)
    outcome.on_row(6, 1)
    outcome.on_tokens(1, 2.75)
    assert outcome.recomputed == 5
    assert outcome.ttft_s == 0.25
    assert outcome.tpot_s == pytest.approx(1.5 / 3)
    assert outcome.max_gap_s == 1.0
    assert not outcome.met_slo()  # not completed yet
    outcome.completed = True
    assert not outcome.met_slo()  # TPOT 0.5 s over its 0.2 s
    assert _completed(Slo(ttft_s=0.5)).met_slo()
    assert not _completed(Slo(ttft_s=0.1)).met_slo()
    assert _completed(None).met_slo()  # no SLO: every completed request counts


def _completed(slo: Slo | None) -> Outcome:
    outcome = _outcome(slo)
    outcome.on_tokens(1, 1.25)
    outcome.on_tokens(1, 1.5)
    outcome.completed = True
    return outcome


def test_bench_json_reports_every_class_for_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    assert main(["bench", "--scenario", str(path), "--policy", "preempt,banker", "--json"]) == 0
    preempt, banker = json.loads(capsys.readouterr().out)
    for metrics in (preempt, banker):
        assert set(metrics["preemptions_by_class"]) == {"voice", "batch", "plain"}
        assert set(metrics["tpot_by_class"]) == {"voice", "batch", "plain"}
        met = sum(c["met_slo"] for c in metrics["goodput_by_class"].values())
        assert metrics["goodput_per_s"] == pytest.approx(met / metrics["duration_s"], rel=1e-3)
        plain = metrics["goodput_by_class"]["plain"]
        assert plain["met_slo"] == plain["completed"] > 0  # no SLO: every completed request
        assert metrics["max_stall_s"] >= metrics["tpot_p99_s"] > 0
        assert sum(metrics["preemptions_by_class"].values()) == metrics["preemptions"]
    assert preempt["preemptions"] > 0 and preempt["recomputed_tokens"] > 0
    # The banker runs batch as best-effort: only it may be preempted, never a strict class.
    assert banker["preemptions_by_class"]["voice"] == banker["preemptions_by_class"]["plain"] == 0
    assert banker["recomputed_by_class"]["voice"] == banker["recomputed_by_class"]["plain"] == 0
    assert banker["admitted_as"] == {"voice": "strict", "batch": "best-effort", "plain": "strict"}
    assert preempt["admitted_as"]["batch"] == "best-effort, ignored by this baseline"


def test_the_table_says_how_classes_were_admitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    assert main(["bench", "--scenario", str(path), "--policy", "peak+backfill"]) == 0
    out = capsys.readouterr().out
    assert "| goodput/s |" in out and "preempt batch" in out
    assert "admitted as, under peak+backfill: batch best-effort; plain strict; voice strict" in out


def test_the_class_plot_shows_pages_held_by_each_class(tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    plot = tmp_path / "classes.png"
    argv = ["bench", "--scenario", str(path), "--policy", "preempt,peak", "--plot-classes"]
    assert main([*argv, str(plot)]) == 0
    assert plot.stat().st_size > 10_000
    assert main([*argv, str(tmp_path / "missing" / "classes.png")]) == 2


def test_the_class_timeline_adds_up_to_what_requests_hold() -> None:
    from kvbank.engine.bench.simulate import run_policy

    scenario = parse_scenario(__import__("yaml").safe_load(MIXED))
    result = run_policy(scenario, "preempt")
    assert len(result.class_timeline) == len(result.timeline)
    assert max(sum(held) for _, held in result.class_timeline) > 0
    # A page two requests share counts for each: the classes add up to at least what is held.
    for (t, held, _), (t2, by_class) in zip(result.timeline, result.class_timeline, strict=True):
        assert t == t2 and sum(by_class) >= held
