"""The picker against peak-fit pods: a request whose worst case is over every pod's headroom,
but whose pages at each step fit beside what the pods' running requests may hold then, is one
those ledgers admit now. The picker tests it on each pod's room curve and picks it at once, with
a NOW hold, instead of holding it in its lobby until a headroom grows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from picker_harness import Pod, ThreadPicker
from test_picker_protocol import answers, destination

from kvbank.proto import admission_pb2 as pb

# A running request on each pod: 2 pages of prompt now, growing to 60 at step 927.
LONG = pb.PeakShape(labels=["main"], base=[32], per_output=[1], worst=[960], output_budget=928,
                    prefill_chunks=1)  # fmt: skip


@pytest.fixture
def peak_pods() -> Iterator[list[Pod]]:
    running = [Pod(i, policy="peak") for i in range(2)]
    try:
        for pod in running:
            pod.admit("long", 60, LONG)
        yield running
    finally:
        for pod in running:
            pod.stop()


def test_a_request_over_the_headroom_that_a_peak_fit_pod_admits_is_picked_at_once(
    peak_pods: list[Pod], pool_file: Path
) -> None:
    assert {pod.figures().headroom_pages for pod in peak_pods} == {40}
    picker = ThreadPicker(peak_pods, pool_file).start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            extproc = ep_grpc.ExternalProcessorStub(channel)
            # 640 prompt tokens and 100 of output: 47 pages at worst, over the 40, reached at
            # step 99 and gone long before the running requests reach their 60.
            body = {"model": "tiny", "prompt": list(range(1, 641)), "max_tokens": 100}
            header, _, hold = destination(answers(extproc, body))
    finally:
        picker.shutdown()
    chosen = next(pod for pod in peak_pods if pod.endpoint == header)
    figures = chosen.figures()
    # A NOW hold: off the headroom and the curve, not queued behind the ledger's waiting.
    assert (figures.holds, list(figures.waiting_pages), figures.headroom_pages) == (1, [], 0)
    assert figures.room_pages and min(figures.room_pages) == 40 - 47
    chosen.submit(hold, 47)  # the engine's submit carries the hold back
    assert chosen.figures().holds == 0
