"""The Gateway API Inference Extension's model-server gauges, read as kvbank means them: the KV
usage is the promised fraction of the pool, so it reads a request's whole reservation from its
first token, long before the request holds those pages."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import SMALL_POOL, LiveServer, live_server

USABLE = 63  # SMALL_POOL: 64 pages, one the sink
# 4 prompt tokens + 600 max_tokens + the speculative step = 605 positions: 38 pages of 16.
LONG = {"prompt": [0, 11, 12, 13], "max_tokens": 600, "temperature": 0, "stream": True}
RESERVED = 38


@pytest.fixture(scope="module")
def banker(builtin_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(builtin_model_dir, options=replace(SMALL_POOL, policy="banker")) as server:
        yield server


def test_usage_is_the_promised_fraction_not_the_held_one(banker: LiveServer) -> None:
    banker.wait_for(**{"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0})
    with (
        httpx.Client(base_url=banker.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=LONG) as first,
    ):
        lines = first.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        # A second one cannot fit beside it (38 + 38 > 63): it waits.
        second = threading.Thread(
            target=lambda: httpx.post(
                banker.url + "/v1/completions", json={**LONG, "stream": False}, timeout=120
            )
        )
        second.start()
        figures = banker.wait_for(
            **{"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 1}
        )
        assert figures["vllm:kv_cache_usage_perc"] == pytest.approx(RESERVED / USABLE)
        held = figures["kvbank_pool_held_pages"]
        assert held < RESERVED  # it holds a few pages yet; the gauge counts all it may take
        assert figures["kvbank_outstanding_pages"] == RESERVED - held
    second.join(120)  # the first stream closed: its request aborted, the second one ran
    banker.wait_for(**{"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                       "vllm:kv_cache_usage_perc": 0})  # fmt: skip


def test_preemptions_are_counted_by_service_class(builtin_model_dir: Path) -> None:
    # The preempt baseline admits two 38-page requests into 63 pages on their prompts alone;
    # when decode runs short it preempts one, which /metrics counts.
    preempt = replace(SMALL_POOL, policy="preempt", max_waiting=4)
    with live_server(builtin_model_dir, options=preempt) as server:
        series = 'kvbank_preemptions_total{service_class="strict"}'
        assert server.figures()[series] == 0
        statuses: list[int] = []
        body = {**LONG, "stream": False}
        workers = [
            threading.Thread(
                target=lambda: statuses.append(
                    httpx.post(server.url + "/v1/completions", json=body, timeout=180).status_code
                )
            )
            for _ in range(2)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(180)
        assert statuses == [200, 200]
        assert server.figures()[series] >= 1
