"""Webhook cost, for docs/benchmarks.md: `.venv/bin/python tests/operator/bench_webhook.py`.

Times the judgement alone (`admission.decide`) and whole AdmissionReviews over HTTPS on
loopback through kopf's server, with the in-memory cluster behind it (so no apiserver time)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_webhook_server as harness
from operator_specs import pool_doc
from test_webhook_server import _review

from kvbank.operator.admission import Neighbourhood, decide

SPECS = {
    "example (1 label, 8k)": pool_doc(),
    "2 labels, 32k": pool_doc(
        kvSlots={"main": {"prompt": 1, "output": 1}, "vision": {"fixed": 2000, "output": 1}},
        limits={"maxSeqLen": 32768, "maxTokens": 8192},
        kv={"pageSize": 16, "pages": 40000},
    ),
    "unholdable (binary searches)": pool_doc(kv={"pageSize": 16, "pages": 400}),
}


def time_decide(runs: int = 200) -> None:
    for label, doc in SPECS.items():
        samples = []
        for _ in range(runs):
            started = time.perf_counter()
            decide(doc, Neighbourhood({}, [], []))
            samples.append(time.perf_counter() - started)
        print(f"decide {label}: median {statistics.median(samples) * 1e6:.0f} us")


async def time_round_trips(reviews: int = 300) -> None:
    """The test's harness serves the webhook and calls ROUND_TRIPS with its client session."""
    samples: list[float] = []

    async def ask_many(session: aiohttp.ClientSession, url: str, trusted: object) -> None:
        for i in range(reviews):
            started = time.perf_counter()
            async with session.post(url, json=_review(str(i), pool_doc()), ssl=trusted) as rsp:
                await rsp.json()
            samples.append(time.perf_counter() - started)

    harness.ROUND_TRIPS = ask_many
    try:
        await harness._serve_and_ask(harness._free_port())
    finally:
        harness.ROUND_TRIPS = None
    samples.sort()
    p50 = samples[len(samples) // 2] * 1e3
    p99 = samples[int(len(samples) * 0.99)] * 1e3
    print(f"AdmissionReview over HTTPS, {reviews} sequential: p50 {p50:.2f} ms, p99 {p99:.2f} ms")


if __name__ == "__main__":
    time_decide()
    asyncio.run(time_round_trips())
