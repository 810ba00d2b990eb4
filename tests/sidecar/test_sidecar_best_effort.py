"""Strict and best-effort requests with the ledger in a real sidecar process: best-effort
requests never reach it, the supply it is told counts their pages as reclaimable, a promoted
request is submitted to it, and `kvbank bench --sidecar` prints exactly the embedded JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sidecar_harness import bench_both_ways

# Strict voice beside best-effort batch in a tight pool with a host tier: preemptions and
# promotions happen (the test checks they did).
MIXED = """
name: mixed
pool: {pages: 40, page_size: 4, host_pages: 32}
model:
  kv_slots: {main: {prompt: 1, output: 1}}
  max_seq_len: 128
  max_tokens_default: 64
  speculative_tokens: 1
cost_model: {host_ms_per_page: 0.08}
workload:
  concurrency: 8
  requests: 80
  seed: 5
  classes:
    - {name: voice, weight: 1, service_class: strict, prompt_tokens: {min: 4, max: 12},
       max_tokens: 24, output_tokens: {min: 8, max: 24}}
    - {name: batch, weight: 2, service_class: best-effort, prompt_tokens: {min: 8, max: 40},
       output_tokens: {min: 4, max: 50}}
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("policy", "victim"),
    [("peak+backfill", "newest"), ("peak+backfill", "cheapest"), ("banker", "newest")],
)
def test_bench_over_a_sidecar_gives_the_embedded_json_with_best_effort_requests(
    tmp_path: Path, policy: str, victim: str
) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    local, remote, served = bench_both_ways(
        ["--scenario", str(path), "--policy", policy, "--json", "--victim", victim],
        ["--metrics-port", "-1", "--debug", "--policy", policy],
    )
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    embedded, sidecar = json.loads(local.stdout)[0], json.loads(remote.stdout)[0]
    assert sidecar == embedded
    assert embedded["completed"] == 80 and embedded["invariant_breaches"] == 0
    assert embedded["preemptions_by_class"]["voice"] == 0
    assert embedded["preemptions_by_class"]["batch"] > 0
    voice = embedded["goodput_by_class"]["voice"]["completed"]
    # Only strict requests reach the ledger: the voice ones, and the promoted batch ones.
    assert voice <= served.next_seq < 80
