"""`vllm serve` with kvbank's scheduler class under `KVBANK_ORDER=prefix` (kvbank/vllm/order.py)
beside stock vLLM: two shared prompts under KV pressure, served with no preemption and stock's
greedy tokens. The ledger is a real `kvbank sidecar` process's, which the engine never waits on,
as the operator's pods run it: the order is kept between reports (the embedded ledger's served
runs are benchmarks/vllm_cpu.py's; the scheduler tests run both). Servers of their own, started
after test_serve.py's have stopped, so no test there shares the cores with a third server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_serve import BLOCKS, MAX_MODEL_LEN, press
from vllm_server import VllmServer, start_all

from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, sidecar: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list]:
    logs = tmp_path_factory.mktemp("vllm-serve-order")
    common = {"blocks": BLOCKS, "max_model_len": MAX_MODEL_LEN}
    env = {"KVBANK_POLICY": "peak+backfill", "KVBANK_ORDER": "prefix", "KVBANK_SIDECAR": sidecar}
    both = start_all(
        [
            VllmServer(model_dir, logs / "kvbank-prefix.log", kvbank=True, env=env, **common),
            VllmServer(model_dir, logs / "stock.log", kvbank=False, **common),
        ]
    )
    yield both
    for server in both:
        server.stop()


def test_in_prefix_order_two_shared_prompts_are_served_with_no_preemption(
    servers: list[VllmServer], sidecar: str
) -> None:
    # Two shared prompts of about 250 tokens (a block and more each), twelve requests in turn
    # from each, 240 tokens out: about 4 blocks each at its end, 15 blocks in the pool.
    prefix_order, stock = servers
    prefixes = ("alpha " * 50, "beta gamma " * 25)
    requests, max_tokens = 12, 240
    results = {}
    for name, server in (("stock", stock), ("prefix", prefix_order)):
        before = server.metric("vllm:num_preemptions_total")
        served = press(server, requests, max_tokens, prefixes=prefixes)
        results[name] = (served, server.metric("vllm:num_preemptions_total") - before)
    assert results["stock"][1] > 0, "the pool was not under pressure: stock vLLM never preempted"
    served, preemptions = results["prefix"]
    assert preemptions == 0, f"kvbank's admission let vLLM preempt {preemptions}"
    assert [len(ids) for ids in served] == [max_tokens] * requests
    assert served == results["stock"][0]  # the order changes when, not what
    with SidecarClient(sidecar) as client:  # the sidecar's books: nothing left waiting
        status = client.status_reply()
    assert status.pool.total_pages == BLOCKS and not status.waiting, status
