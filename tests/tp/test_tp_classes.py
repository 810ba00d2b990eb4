"""Strict and best-effort requests at TP 2, with real gloo ranks on loopback: rank 0 journals
each request with the class it asked for, every rank admits, preempts (victim pages cached,
copied to host and reloaded) and promotes alike (the ranks agree on every batch's digest, host
copies included), and the group's outputs and preemptions are exactly one rank's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tp_procs import ROOT, child_env, free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from class_ranks import single  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["newest", "cheapest"])
def test_tp2_admits_and_preempts_best_effort_requests_like_one_rank(victim: str) -> None:
    master = f"127.0.0.1:{free_port()}"
    script = str(HERE / "class_ranks.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--rank", str(rank), "--master", master, "--victim", victim],
            env=child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        results = [proc.communicate(timeout=100) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err.decode()[-2000:]
    group = json.loads(results[0][0])
    alone = single(victim)
    assert group == alone
    preempted = alone["preempted"]
    assert sum(preempted.values()) > 0  # the pool is tight enough to preempt
    assert max(preempted.values()) == 2  # and to promote (max_preemptions 2)
    strict = [f"r{i}" for i in range(24) if i % 3 == 0]
    assert all(preempted[rid] == 0 for rid in strict)
    assert all(len(out) > 0 for out in alone["outputs"].values())
