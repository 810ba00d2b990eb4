"""benchmarks/vllm_gpu.py without a GPU: the runs it makes, each one's `vllm serve` command line
and environment, and its arguments. The script itself runs only where vLLM has a CUDA device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


gpu = load_benchmark("vllm_gpu")


def test_every_kvbank_run_has_its_stock_baseline() -> None:
    runs = gpu.RUNS.values()
    assert {r.baseline for r in runs if r.kvbank} <= {r.name for r in runs if not r.kvbank}
    # async scheduling, a sliding-window model and a Unix-socket sidecar are each covered
    assert any(r.kvbank and r.async_scheduling for r in runs)
    assert any(r.kvbank and r.model == "sliding" for r in runs)
    assert any(r.kvbank and r.sidecar for r in runs)


def test_the_command_line_follows_the_run() -> None:
    run = gpu.RUNS["kvbank-llama-async-sidecar"]
    cmd, env = gpu.serve_command(run, Path("/m"), 18100, "unix:///tmp/s.sock")
    assert "--async-scheduling" in cmd and "--no-async-scheduling" not in cmd
    assert cmd[cmd.index("--scheduler-cls") + 1] == "kvbank.vllm.KvbankScheduler"
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == str(gpu.BLOCKS)
    assert env["KVBANK_SIDECAR"] == "unix:///tmp/s.sock"
    assert env["KVBANK_POLICY"] == "peak+backfill"
    stock, stock_env = gpu.serve_command(gpu.RUNS["stock-llama-sync"], Path("/m"), 18101, None)
    assert "--no-async-scheduling" in stock and "--scheduler-cls" not in stock
    ours = {k: v for k, v in stock_env.items() if k.startswith("KVBANK_")}
    assert ours == {k: v for k, v in os.environ.items() if k.startswith("KVBANK_")}


def test_arguments() -> None:
    args = gpu.parse_args(["--run", "stock-llama-async", "--run", "kvbank-llama-async"])
    assert args.run == ["stock-llama-async", "kvbank-llama-async"]
    assert gpu.parse_args([]).run == list(gpu.RUNS)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--run", "nonsense"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--requests", "0"])
