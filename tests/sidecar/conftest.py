"""Fixtures for the sidecar tests: a real server on loopback and a client of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sidecar_harness import ThreadSidecar, make_config

from kvbank.sidecar.client import SidecarClient


@pytest.fixture
def sidecar() -> Iterator[ThreadSidecar]:
    running = ThreadSidecar(make_config(pool_pages=101)).start_and_wait()
    yield running
    running.shutdown()


@pytest.fixture
def client(sidecar: ThreadSidecar) -> Iterator[SidecarClient]:
    with SidecarClient(sidecar.address, retry_budget_s=2.0) as c:
        yield c
