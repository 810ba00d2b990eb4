"""What the engine reads and shows for `kvbank picker` and metric-only pickers: a request routed
by kvbank picker carries its hold as `x-kvbank-hold`, which the engine takes as the request's id
(so its sidecar's view of the submit releases the hold); `vllm:cache_config_info` names the
pool's page size and page count."""

from __future__ import annotations

from conftest import LiveServer

from kvbank.capacity import CapacityModel, worst_case
from kvbank.engine.serve.from_pool import DECODER_SLOT

BODY = {"prompt": "page cache", "max_tokens": 2}


def test_the_pickers_id_becomes_the_request_id(server: LiveServer) -> None:
    hold = "cmpl-" + "ab" * 16
    reply = server.client.post("/v1/completions", json=BODY, headers={"x-kvbank-hold": hold})
    assert reply.status_code == 200 and reply.json()["id"] == hold


def test_an_id_not_in_the_pickers_form_is_ignored(server: LiveServer) -> None:
    for hold in ("cmpl-short", "chatcmpl-" + "ab" * 16, "cmpl-" + "AB" * 16, "x" * 5000):
        reply = server.client.post("/v1/completions", json=BODY, headers={"x-kvbank-hold": hold})
        assert reply.status_code == 200
        assert reply.json()["id"] != hold and reply.json()["id"].startswith("cmpl-")


def test_the_cache_config_info_names_the_page_size_and_the_pool(server: LiveServer) -> None:
    text = server.client.get("/metrics").text
    line = next(row for row in text.splitlines() if row.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in line and line.endswith(" 1.0")
    assert 'num_gpu_blocks="' in line


def test_headroom_and_admissible_worst_cases_are_on_the_engines_metrics(
    server: LiveServer,
) -> None:
    figures = server.settled()
    idle = figures["kvbank_pool_free_pages"] + figures["kvbank_pool_evictable_pages"]
    assert figures["kvbank_headroom_pages"] == idle > 0  # nothing runs: every page is supply
    # This pool's worst case (2,048 positions: 128 pages) is more than its 63 usable pages.
    worst = worst_case(CapacityModel({"main": DECODER_SLOT}, 16, 2048, 2000))[1].total
    assert worst == 128
    assert figures["kvbank_admissible_worst_case_requests"] == idle // worst == 0
