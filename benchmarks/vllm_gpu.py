"""The shared-prefix repro on a GPU, in real `vllm serve`: stock vLLM against vLLM with kvbank's
scheduler class, under vLLM's async scheduling (its default) and without, on a full-attention
model and a sliding-window one, with the ledger embedded and in a `kvbank sidecar` over a Unix
socket. Prints preemptions, requests/s and TPOT for each run, and kvbank's ratios to stock's.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_gpu.py [--requests 64] [--out DIR] \\
        [--run NAME ...]

No download: the models are small random-weight ones written to a local directory (a Llama of 8
layers, hidden 1024, and a Mistral of the same shape whose layers attend to a 256-token sliding
window), served with --skip-tokenizer-init (prompts are token ids; `ignore_eos` makes every
request produce exactly its max_tokens). The pool is the scenario's: 96 blocks of 16 tokens
(--num-gpu-blocks-override), and `concurrency` clients send the same 944-token prompt (59 blocks,
all shared) with max_tokens 160, closed loop. Every server runs eager (--enforce-eager: the runs
are short, CUDA-graph capture would dominate them). Preemptions and TPOT are read from each
server's Prometheus metrics (vllm:num_preemptions, vllm:request_time_per_output_token_seconds).
Every server and sidecar listens on 127.0.0.1 or a socket in --out and is stopped; every request
has a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, MAX_TOKENS, BLOCKS, BLOCK = 944, 160, 96, 16
WINDOW = 256  # the sliding-window model's window, in tokens
POLICY = "peak+backfill"


@dataclass(frozen=True)
class Run:
    """One server: which model, stock or kvbank's class, vLLM's scheduling, and where the
    ledger lives (embedded, or a sidecar on a Unix socket)."""

    name: str
    model: str  # "llama" or "sliding"
    kvbank: bool
    async_scheduling: bool
    sidecar: bool = False

    @property
    def baseline(self) -> str:
        """The stock run kvbank's is compared with: same model, same scheduling."""
        return f"stock-{self.model}-{'async' if self.async_scheduling else 'sync'}"


RUNS = {
    run.name: run
    for run in (
        Run("stock-llama-async", "llama", kvbank=False, async_scheduling=True),
        Run("kvbank-llama-async", "llama", kvbank=True, async_scheduling=True),
        Run(
            "kvbank-llama-async-sidecar", "llama", kvbank=True, async_scheduling=True, sidecar=True
        ),
        Run("stock-llama-sync", "llama", kvbank=False, async_scheduling=False),
        Run("kvbank-llama-sync", "llama", kvbank=True, async_scheduling=False),
        Run("stock-sliding-async", "sliding", kvbank=False, async_scheduling=True),
        Run("kvbank-sliding-async", "sliding", kvbank=True, async_scheduling=True),
    )
}


def write_model(path: Path, kind: str) -> None:
    """A random-weight model in safetensors, shaped like a small real one: a Llama, or a Mistral
    whose every layer attends to a WINDOW-token sliding window."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    shape = {
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    }  # fmt: skip
    torch.manual_seed(0)
    if kind == "sliding":
        model: torch.nn.Module = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def metric_sum(text: str, name: str) -> float:
    """Sum of a Prometheus sample over its labels (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def serve_command(
    run: Run, model: Path, port: int, sidecar: str | None
) -> tuple[list[str], dict[str, str]]:
    """`vllm serve`'s command line and environment for one run."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS),
        "--max-model-len", "1200", "--enforce-eager", "--served-model-name", "tiny",
        "--async-scheduling" if run.async_scheduling else "--no-async-scheduling",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if run.kvbank:
        cmd += ["--scheduler-cls", "kvbank.vllm.KvbankScheduler"]
        env["KVBANK_POLICY"] = POLICY
        if sidecar is not None:
            env["KVBANK_SIDECAR"] = sidecar
    return cmd, env


def start_sidecar(socket_path: Path, log: Path) -> subprocess.Popen[bytes]:
    """`kvbank sidecar` on a Unix socket, as a pod's sidecar serves its engine; it takes the
    pool's size from the engine's session."""
    socket_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", f"unix://{socket_path}",
        "--metrics-port", "-1", "--policy", POLICY,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvbank sidecar did not start; see {log}")
        time.sleep(0.2)
    return proc


def wait_ready(proc: subprocess.Popen[bytes], port: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vllm serve not ready within {limit_s:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def load(port: int, requests: int, concurrency: int, timeout_s: float) -> tuple[int, float]:
    """Closed loop: `concurrency` clients, `requests` in all. Returns (completed, seconds)."""
    prompt = [2 + (i * 7919) % 31000 for i in range(PROMPT_TOKENS)]  # one shared prompt
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
         "ignore_eos": True, "temperature": 0.0}
    ).encode()  # fmt: skip
    left, done, lock = [requests], [0], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                body,
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                    tokens = json.loads(reply.read())["usage"]["completion_tokens"]
            except OSError as exc:
                print(f"  a request failed: {exc}", file=sys.stderr)
                continue
            if tokens == MAX_TOKENS:
                with lock:
                    done[0] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * requests)
    return done[0], time.monotonic() - started


def measure(run: Run, args: argparse.Namespace, port: int) -> dict[str, object]:
    model = args.out / f"tiny-{run.model}-random"
    write_model(model, run.model)
    sidecar_proc = None
    sidecar = None
    if run.sidecar:
        socket_path = args.out / f"{run.name}.sock"
        sidecar_proc = start_sidecar(socket_path, args.out / f"{run.name}-sidecar.log")
        sidecar = f"unix://{socket_path}"
    cmd, env = serve_command(run, model, port, sidecar)
    proc = subprocess.Popen(
        cmd, env=env, stdout=(args.out / f"{run.name}.log").open("wb"), stderr=subprocess.STDOUT
    )
    try:
        wait_ready(proc, port, args.ready_s)
        before = scrape(port)
        done, seconds = load(port, args.requests, args.concurrency, args.request_timeout_s)
        after = scrape(port)
    finally:
        stop(proc)
        if sidecar_proc is not None:
            stop(sidecar_proc)
    tpot = "vllm:request_time_per_output_token_seconds"
    count = metric_sum(after, f"{tpot}_count") - metric_sum(before, f"{tpot}_count")
    total = metric_sum(after, f"{tpot}_sum") - metric_sum(before, f"{tpot}_sum")
    return {
        "completed": done,
        "requests": args.requests,
        "seconds": round(seconds, 2),
        "requests_per_s": round(done / seconds, 3) if seconds else 0.0,
        "preemptions": int(
            metric_sum(after, "vllm:num_preemptions_total")
            - metric_sum(before, "vllm:num_preemptions_total")
        ),
        "tpot_mean_ms": round(1000 * total / count, 2) if count else None,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--ready-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--run", action="append", choices=list(RUNS), help="a run (repeatable; default: all)"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    args.run = args.run or list(RUNS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    for port, name in enumerate(args.run, start=18100):
        results[name] = measure(RUNS[name], args, port)
        print(name, json.dumps(results[name]), flush=True)
    for name in args.run:
        run = RUNS[name]
        stock = results.get(run.baseline)
        if run.kvbank and stock and stock["requests_per_s"]:
            ratio = float(results[name]["requests_per_s"]) / float(stock["requests_per_s"])
            print(f"requests/s {name} / {run.baseline}: {ratio:.3f}")
    (args.out / "vllm_gpu.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
