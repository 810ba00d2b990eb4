"""Fixtures: two pods (real sidecars with open engine sessions) and a picker over them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from picker_harness import POOL, Pod, ThreadPicker


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL)
    return path


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    running = [Pod(i) for i in range(2)]
    yield running
    for pod in running:
        pod.stop()


@pytest.fixture
def picker(pods: list[Pod], pool_file: Path) -> Iterator[ThreadPicker]:
    running = ThreadPicker(pods, pool_file).start_and_wait()
    yield running
    running.shutdown()


@pytest.fixture
def extproc(picker: ThreadPicker) -> Iterator[ep_grpc.ExternalProcessorStub]:
    with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
        yield ep_grpc.ExternalProcessorStub(channel)
