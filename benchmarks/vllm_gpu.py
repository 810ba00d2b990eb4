"""The shared-prefix repro on a GPU, in real `vllm serve`: stock vLLM against vLLM with kvbank's
scheduler class. Prints preemptions, requests/s and TPOT for each.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_gpu.py [--requests 64] [--out DIR]

No download: the model is a small Llama (8 layers, hidden 1024) with random weights, written to a
local directory, served with --skip-tokenizer-init (prompts are token ids; `ignore_eos` makes
every request produce exactly its max_tokens). The pool is the scenario's: 96 blocks of 16
tokens (--num-gpu-blocks-override), and `concurrency` clients send the same 944-token prompt
(59 blocks, all shared) with max_tokens 160, closed loop. Both servers run synchronously
(--no-async-scheduling: kvbank's class requires it) and eager (--enforce-eager: the runs are
short, CUDA-graph capture would dominate them). Preemptions and TPOT are read from each
server's Prometheus metrics (vllm:num_preemptions, vllm:request_time_per_output_token_seconds).
Every server listens on 127.0.0.1 and is stopped; every request has a timeout.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, MAX_TOKENS, BLOCKS, BLOCK = 944, 160, 96, 16


def write_model(path: Path) -> None:
    """A random-weight Llama in safetensors, shaped like a small real one."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def metric_sum(text: str, name: str) -> float:
    """Sum of a Prometheus sample over its labels (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def serve(model: Path, port: int, kvbank: bool, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS),
        "--max-model-len", "1200", "--no-async-scheduling", "--enforce-eager",
        "--served-model-name", "tiny-llama",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if kvbank:
        cmd += ["--scheduler-cls", "kvbank.vllm.KvbankScheduler"]
        env["KVBANK_POLICY"] = "peak+backfill"
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


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


def load(port: int, requests: int, concurrency: int, timeout_s: float) -> tuple[int, float]:
    """Closed loop: `concurrency` clients, `requests` in all. Returns (completed, seconds)."""
    prompt = [2 + (i * 7919) % 31000 for i in range(PROMPT_TOKENS)]  # one shared prompt
    body = json.dumps(
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--ready-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tiny-llama-random"
    write_model(model)
    results = {}
    for name, kvbank, port in (("vllm", False, 18100), ("vllm+peak+backfill", True, 18101)):
        proc = serve(model, port, kvbank, args.out / f"{name}.log")
        try:
            wait_ready(proc, port, args.ready_s)
            before = scrape(port)
            done, seconds = load(port, args.requests, args.concurrency, args.request_timeout_s)
            after = scrape(port)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        tpot = "vllm:request_time_per_output_token_seconds"
        count = metric_sum(after, f"{tpot}_count") - metric_sum(before, f"{tpot}_count")
        total = metric_sum(after, f"{tpot}_sum") - metric_sum(before, f"{tpot}_sum")
        results[name] = {
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
        print(name, json.dumps(results[name]), flush=True)
    stock, ours = results["vllm"], results["vllm+peak+backfill"]
    if stock["requests_per_s"]:
        ratio = ours["requests_per_s"] / stock["requests_per_s"]
        print(f"requests/s vllm+peak+backfill / vllm: {ratio:.3f}")
    (args.out / "vllm_gpu.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
