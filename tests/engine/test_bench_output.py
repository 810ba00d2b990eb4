"""What `kvbank bench` shows a reader: a table that explains its columns and shows no latency for
a policy that completed nothing, a progress bar even on a short run, and a plot where every
policy's line can be told apart, the pool limit is named and a deadlock is marked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbank.cli import main
from kvbank.engine.bench.plot import figure
from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
SHARED_PREFIX = str(SCENARIOS / "shared-prefix.yaml")


def test_the_table_explains_its_columns_and_dashes_a_policy_that_completed_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--scenario", SHARED_PREFIX, "--policy", "optimistic,banker"]) == 0
    captured = capsys.readouterr()
    # optimistic deadlocks on this scenario: 0 done, 32 hung, so no TTFT to speak of.
    assert re.search(r"\| optimistic +\| 0 +\| 32 +\| 0 +\| 0\.000 +\| - +\| - +\|", captured.out)
    assert re.search(r"\| banker +\| 32 +\| 0 +\| 0 +\| [\d.]+ +\| [\d.]+s +\|", captured.out)
    for column in ("hung", "TTFT p50/p99", "KV util", "hit rate", "max run", "virtual s"):
        assert re.search(rf"^ *{re.escape(column)}  \S", captured.out, re.M), column
    # The progress bar shows on a run of a fraction of a second too (it goes to stderr).
    assert "shared-prefix/banker" in captured.err


def test_a_plot_into_a_missing_folder_is_refused_before_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--scenario", SHARED_PREFIX, "--policy", "banker"]
    assert main([*argv, "--plot", "/nonexistent/x.png"]) == 2
    captured = capsys.readouterr()
    assert "the folder /nonexistent does not exist" in captured.err
    assert "| banker" not in captured.out  # nothing ran
    assert not Path("/nonexistent").exists()


def test_the_plot_says_where_it_went(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "sp.png"
    argv = ["bench", "--scenario", SHARED_PREFIX, "--policy", "banker", "--plot", str(target)]
    assert main(argv) == 0
    assert f"plot written to {target}" in capsys.readouterr().err
    assert target.stat().st_size > 10_000


def test_the_plot_tells_coinciding_policies_apart_and_marks_the_deadlock() -> None:
    import matplotlib.pyplot as plt

    scenario = load_scenario(SHARED_PREFIX)
    policies = ("banker", "banker+backfill", "optimistic")
    results = [run_policy(scenario, name) for name in policies]
    # banker+backfill draws exactly banker's line on this scenario: the case to tell apart.
    assert results[0].timeline == results[1].timeline
    fig = figure(scenario, results)
    try:
        pages_ax = fig.axes[0]
        lines = {line.get_label(): line for line in pages_ax.get_lines()}
        looks = {
            (lines[p].get_linestyle(), lines[p].get_marker(), lines[p].get_linewidth())
            for p in policies
        }
        assert len(looks) == len(policies)  # each its own dashes, marker and width
        assert pages_ax.get_legend() is None and len(fig.legends) == 1  # outside the axes
        texts = [t.get_text() for t in pages_ax.texts]
        assert f"pool limit: {scenario.pages - 1} usable pages" in texts
        assert "optimistic: deadlock" in texts
        width, height = fig.get_size_inches()
        assert width >= 12 and height >= 8
    finally:
        plt.close(fig)
