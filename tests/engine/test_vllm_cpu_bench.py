"""benchmarks/vllm_cpu.py without a server: its arguments, the guidellm command it builds, and
what it reads from a recorded guidellm 0.8.1 JSON report (four requests of a real run, trimmed
to the fields the benchmark reads), so a change on either side fails here first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

from kvbank.engine.bench.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = Path(__file__).with_name("guidellm_report_fragment.json")


bench = load_benchmark("vllm_cpu")


def report() -> dict:
    return json.loads(FRAGMENT.read_text())


def test_default_arguments_run_every_workload() -> None:
    args = bench.parse_args([])
    assert args.workload == ["thrash", "short", "short-flex", "loose"]
    assert bench.WORKLOADS["short-flex"].data == bench.WORKLOADS["short"].data
    assert bench.WORKLOADS["short-flex"].default_class == "best-effort"
    assert (args.slo_ttft_ms, args.slo_tpot_ms, args.requests, args.json) == (2000, 50, None, False)


def test_workloads_and_overrides_parse() -> None:
    args = bench.parse_args(["--workload", "short", "--requests", "8", "--json"])
    assert (args.workload, args.requests, args.json) == (["short"], 8, True)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workload", "nope"], "--workload"),
        (["--requests", "0"], "--requests"),
        (["--slo-tpot-ms", "-1"], "--slo-tpot-ms"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert named in capsys.readouterr().err


def test_summary_of_a_recorded_report() -> None:
    result = bench.summarize(
        report(), engine="stock", workload="short", rate=6.0, slo=bench.Slo(2000, 50)
    )
    # The four requests start at ...78.918 and the last ends at ...83.718: a 4.80 s span.
    assert result.span_s == pytest.approx(4.8002, abs=1e-3)
    assert (result.requests_ok, result.requests_failed) == (4, 0)
    assert result.requests_per_s == pytest.approx(4 / 4.8002, rel=1e-3)
    assert result.output_tokens_per_s == pytest.approx((169 + 162 + 32 + 136) / 4.8002, rel=1e-3)
    # TTFT 34.3, 39.3, 179.1, 298.7 ms: the median is between the middle two.
    assert result.ttft_p50_ms == pytest.approx((39.307 + 179.137) / 2, abs=0.01)
    assert result.ttft_p99_ms == pytest.approx(179.137 + 0.97 * (298.669 - 179.137), abs=0.01)
    # TPOT is guidellm's inter-token latency (12.5, 16.5, 23.2, 27.0 ms), not its
    # time_per_output_token_ms, which counts the first token's wait as well.
    assert result.tpot_p50_ms == pytest.approx((16.458 + 23.217) / 2, abs=0.01)
    assert result.slo_met == 4 and result.goodput_per_s == result.requests_per_s


def test_goodput_counts_only_requests_within_both_bounds() -> None:
    tight = bench.summarize(
        report(), engine="kvbank", workload="short", rate=6.0, slo=bench.Slo(200, 20)
    )
    assert tight.slo_met == 2  # 179 ms / 12.5 ms and 34 ms / 16.5 ms
    assert tight.goodput_per_s == pytest.approx(2 / tight.span_s)


def test_failed_requests_are_counted_and_a_report_of_several_runs_is_refused() -> None:
    data = report()
    data["benchmarks"][0]["requests"]["errored"] = [{}, {}]
    assert bench.guidellm_requests(data)[1] == 2
    data["benchmarks"].append(data["benchmarks"][0])
    with pytest.raises(ValueError, match="2 benchmarks"):
        bench.guidellm_requests(data)


def test_preemptions_are_summed_over_labels_and_a_missing_series_is_an_error() -> None:
    text = (
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 3.0\n'
        'vllm:num_preemptions_created{engine="0",model_name="m"} 1.79e+09\n'
    )
    assert bench.metric_sum(text, "vllm:num_preemptions_total") == 7.0
    with pytest.raises(ValueError, match="vllm:num_requests_running"):
        bench.metric_sum(text, "vllm:num_requests_running")


def test_guidellm_runs_the_workload_at_a_constant_rate() -> None:
    workload = bench.WORKLOADS["short"]
    command = bench.guidellm_command(
        Path("guidellm"), "http://127.0.0.1:1", Path("/m"), workload, 2.0, Path("r.json")
    )
    assert command[command.index("--profile") + 1] == "kind=constant,rate=2"
    assert command[command.index("--constraint") + 1] == "kind=max_requests,count=64"
    # guidellm 0.8.1 takes the seed as `value` and refuses any other key.
    assert command[command.index("--seed") + 1] == "kind=static,value=0"
    data = command[command.index("--data") + 1]
    assert data.startswith("kind=synthetic_text,")
    assert "prompt_tokens_min=16" in data and "output_tokens_max=400" in data


def test_the_table_gives_kvbank_over_stock() -> None:
    stock = bench.summarize(report(), engine="stock", workload="x", rate=1.0, slo=bench.Slo(1, 1))
    kvbank = bench.Result(**{**bench.asdict(stock), "engine": "kvbank"})
    kvbank.requests_per_s = stock.requests_per_s * 0.5
    stock.preemptions, kvbank.preemptions = 9.0, 0.0
    text = bench.table([stock, kvbank], bench.Slo(1, 1))
    assert "| x | 1/s | 0.500x | 1.000x | 1.000x | nanx | 0 |" in text
    assert math.isnan(bench.ratio(1.0, 0.0))


def test_the_virtual_clock_thrash_scenario_is_the_served_workload() -> None:
    """benchmarks/vllm-cpu-thrash.yaml stands beside the served thrash runs in
    docs/benchmarks.md: the same pool, prefixes, prompt and output ranges, count and top rate,
    with max_tokens equal to each output, as guidellm sends them."""
    served = bench.WORKLOADS["thrash"]
    data = served.data
    scenario = load_scenario(ROOT / "benchmarks" / "vllm-cpu-thrash.yaml")
    assert (scenario.pages, scenario.model.page_size) == (served.blocks, 128)
    workload = scenario.workload
    assert (workload.requests, workload.rate_per_s) == (served.requests, max(served.rates))
    classes = workload.classes
    assert len({c.shared_prefix for c in classes}) == data["prefix_count"]
    prefix = data["prefix_tokens"]
    for c in classes:
        assert c.shared_prefix_tokens == prefix
        own = (c.prompt_tokens.low - prefix, c.prompt_tokens.high - prefix)
        assert own == (data["prompt_tokens_min"], data["prompt_tokens_max"])
        assert c.output_tokens.low == c.output_tokens.high == c.max_tokens
        assert data["output_tokens_min"] <= c.max_tokens <= data["output_tokens_max"]
    outputs = {c.max_tokens for c in classes}
    assert (min(outputs), max(outputs)) == (data["output_tokens_min"], data["output_tokens_max"])
    mean = sum(c.weight * c.max_tokens for c in classes) / sum(c.weight for c in classes)
    assert abs(mean - data["output_tokens"]) <= 8
