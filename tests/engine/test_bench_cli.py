"""`kvbank bench` as a user runs it: bad scenario files, JSON output, the plot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbank.cli import main
from kvbank.engine.bench.scenario import ScenarioError, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"

GOOD = """
name: tiny
pool: {pages: 40, page_size: 4}
model:
  kv_slots: {main: {prompt: 1, output: 1}, cross: {fixed: 8}}
  max_seq_len: 64
  max_tokens_default: 16
  speculative_tokens: 1
  tp: 2
cost_model: {step_base_ms: 8, prefill_ms_per_token: 0.02, decode_ms_per_row: 0.05,
             attn_ms_per_page: 0.002}
time_limit_s: 60
workload:
  rate_per_s: 20
  requests: 12
  seed: 3
  classes:
    - {name: long, weight: 1, prompt_tokens: {min: 8, max: 20}, max_tokens: null,
       output_tokens: {min: 2, max: 9}, fixed_label_tokens: {main: 4}}
    - {name: short, weight: 2, prompt_tokens: 12, shared_prefix: sys, shared_prefix_tokens: 8,
       max_tokens: 6, output_tokens: 4, only_labels: [main]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("pool: {pages: 40, page_size: 4}", "pool: {pages: 40, page_size: 4, colour: red}"),
         "pool.colour: unknown field"),
        (("pool: {pages: 40,", "pool: {pages: -4,"), "pool.pages: must be at least 2, got -4"),
        (("prompt_tokens: 12,", "prompt_tokens: -12,"),
         "workload.classes[1].prompt_tokens: must be at least 1"),
        (("- {name: long, weight: 1,", "- {name: long,"),
         "workload.classes[0].weight: required field is missing"),
        (("only_labels: [main]", "only_labels: [mian]"),
         "workload.classes[1].only_labels: ['mian'] are not labels"),
        (("  rate_per_s: 20\n", ""), "set exactly one of concurrency"),
    ],
)  # fmt: skip
def test_a_malformed_scenario_names_the_field_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: tuple[str, str], field: str
) -> None:
    assert change[0] in GOOD
    path = write(tmp_path, GOOD.replace(change[0], change[1]))
    assert main(["bench", "--scenario", str(path)]) == 2
    assert field in capsys.readouterr().err


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"name": "x", "pool": {"pages": -1}, "model": {}, "workload": {}, "z": 1})
    problems = caught.value.problems
    assert "z: unknown field" in problems[0]
    assert any(p.startswith("pool.page_size: required") for p in problems)
    assert any(p.startswith("workload.classes: must be a non-empty list") for p in problems)


def test_open_loop_scenario_with_every_field_runs_every_policy_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD)
    assert main(["bench", "--scenario", str(path), "--json", "--debug"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows][:5] == [
        "banker",
        "optimistic",
        "preempt",
        "no-evict",
        "ratio",
    ]
    banker = rows[0]
    assert (banker["completed"], banker["hung"], banker["invariant_breaches"]) == (12, 0, 0)
    assert set(banker["ttft_by_class"]) == {"long", "short"}
    assert banker["prefix_hit_rate"] > 0


def test_the_console_script_prints_the_table_and_draws_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "shared-prefix.png"
    out = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "bench", "--scenario",
         str(SCENARIOS / "shared-prefix.yaml"), "--policy", "all", "--plot", str(plot)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| banker +\| 32 +\| 0 +\|", out.stdout), out.stdout
    assert "optimistic: deadlock" in out.stdout
    assert plot.stat().st_size > 10_000


def test_an_unknown_policy_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(SCENARIOS / "shared-prefix.yaml")
    assert main(["bench", "--scenario", path, "--policy", "fifo"]) == 2
    assert "unknown --policy 'fifo'" in capsys.readouterr().err


def test_backfill_on_top_of_banker_and_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD)
    argv = ["bench", "--scenario", str(path), "--json", "--backfill"]
    assert main([*argv, "--policy", "banker,peak,preempt"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["banker+backfill", "peak+backfill", "preempt"]
    assert all(r["hung"] == 0 and r["preemptions"] == 0 for r in rows[:2])
    assert main([*argv, "--policy", "ratio"]) == 2
    assert "--backfill applies to the banker and peak policies" in capsys.readouterr().err
