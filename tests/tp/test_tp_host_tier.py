"""The host tier under tensor parallelism, with real gloo ranks on loopback: every rank evicts
the same pages to host and reloads the same ones (the batch digest covers the copies), and TP 2
answers exactly like TP 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tp_procs import ROOT, child_env, free_port, stop, wait_healthy

# 36 pages of 4 tokens: one prompt (30 pages) fills most of the pool, so the next evicts it.
POOL = ["--pages", "36", "--page-size", "4", "--host-pages", "128", "--max-seq-len", "512"]
FIRST = "The ledger admits a request only if every admitted request can finish. " * 3
SECOND = "A host tier keeps the pages eviction takes, and a hit copies them back. " * 3


def _serve(model: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model),
               "--port", str(port), *POOL, *extra]  # fmt: skip
    return subprocess.Popen(command, env=child_env(), cwd=ROOT)


def _ask(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _moved(url: str, direction: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'kvbank_host_pages_moved_total{{direction="{direction}"}}'):
            return float(line.split()[1])
    return 0.0


@pytest.mark.slow
def test_tp2_reloads_from_host_like_tp1(builtin_model_dir: Path) -> None:
    port1, port2 = free_port(), free_port()
    single = _serve(builtin_model_dir, port1)
    pair = _serve(builtin_model_dir, port2, "--tp", "2")
    try:
        said = {}
        for port, procs in ((port1, [single]), (port2, [pair])):
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, procs)
            # FIRST is cached, SECOND evicts most of it to host, FIRST again reloads it.
            said[port] = [_ask(url, p) for p in (FIRST + "One.", SECOND, FIRST + "Two.")]
            assert _moved(url, "to-host") > 0 and _moved(url, "to-device") > 0
        assert said[port1] == said[port2]
    finally:
        assert stop(pair) == 0
        stop(single)
