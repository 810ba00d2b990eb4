"""Service classes under tensor parallelism, with real gloo ranks on loopback: `kvbank serve
--tp 2` hands its class flags to its ranks, and each request's class travels in rank 0's plan
without upsetting the follower. That the follower grants exactly rank 0's classes is checked
on the journal itself (tests/http/test_class_flags.py), since no batch differs by class until
the engine admits best-effort requests its own way."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tp_procs import ROOT, child_env, free_port, stop, wait_healthy


def _tier(url: str, tier: str | None) -> str:
    body = {"prompt": "The page cache", "max_tokens": 8, "temperature": 0}
    if tier is not None:
        body["service_tier"] = tier
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["service_tier"])


@pytest.mark.slow
def test_tp2_serves_each_class_on_every_rank(builtin_model_dir: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(builtin_model_dir),
               "--port", str(port), "--pages", "128", "--max-seq-len", "512", "--tp", "2",
               "--default-class", "best-effort", "--max-preemptions", "1"]  # fmt: skip
    pair = subprocess.Popen(command, env=child_env(), cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [pair])
        asked = [None, "priority", "flex", "auto", None, "priority"]
        with ThreadPoolExecutor(len(asked)) as pool:  # batched together on both ranks
            echoed = list(pool.map(lambda tier: _tier(url, tier), asked))
        assert echoed == ["flex", "priority", "flex", "flex", "flex", "priority"]
        assert pair.poll() is None  # no rank diverged
        figures = httpx.get(f"{url}/metrics").text
        assert 'kvbank_class_requests_total{service_class="best-effort"} 4.0' in figures
        assert 'kvbank_class_requests_total{service_class="strict"} 2.0' in figures
    finally:
        assert stop(pair) == 0  # rank 0 stops cleanly and tells its follower
