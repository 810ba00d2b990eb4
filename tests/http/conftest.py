"""A real server on loopback over the built-in model, started once per module in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import httpx
import openai
import pytest
from starlette.types import ASGIApp

from kvbank.engine.serve.http.loop import EngineLoop
from kvbank.engine.serve.stack import ServeOptions, build_stack


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from kvbank.engine.model.builtin import builtin_model_dir as build

    torch.set_num_threads(1)  # a tiny model on a shared box: threads only contend
    return build(tmp_path_factory.mktemp("kvbank-cache"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    client: httpx.Client
    loop: EngineLoop

    def figures(self) -> dict[str, float]:
        """Unlabelled gauges and counters from /metrics, by name."""
        figures = {}
        for line in self.client.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                figures[name] = float(value)
        return figures

    def settled(self, within: float = 20, quiet: float = 0.5) -> dict[str, float]:
        """The figures once nothing runs or waits and the request counters have not moved for
        `quiet` seconds: a request an earlier test sent may still be tokenized, outside the
        engine's gauges, and finish after them."""
        deadline = time.monotonic() + within
        last = self.wait_for(within, kvbank_running_requests=0, kvbank_waiting_requests=0)
        while True:
            time.sleep(quiet)
            now = self.wait_for(within, kvbank_running_requests=0, kvbank_waiting_requests=0)
            counters = {k: v for k, v in now.items() if k.startswith("kvbank_requests_total")}
            if counters == {k: v for k, v in last.items() if k.startswith("kvbank_requests_total")}:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"request counters still moving after {within} s: {now}")
            last = now

    def wait_for(self, within: float = 20, **expected: float) -> dict[str, float]:
        deadline = time.monotonic() + within
        while True:
            figures = self.figures()
            if all(figures.get(k) == v for k, v in expected.items()):
                return figures
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never reached {expected} in {within} s: {figures}")
            time.sleep(0.05)


# 64 pages of 16 tokens: 63 for requests, so a 1000-token request (63 pages) fits alone and two
# 600-token requests (38 pages each) cannot run together.
SMALL_POOL = ServeOptions(
    pages=64, page_size=16, max_seq_len=2048, max_tokens=2000, max_waiting=1, max_batch_tokens=256
)


@pytest.fixture(scope="module")
def server(builtin_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(builtin_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def live(builtin_model_dir: Path) -> Iterator[LiveServer]:
    """The small pool with room to queue a batch of prompts at once."""
    with live_server(builtin_model_dir, options=replace(SMALL_POOL, max_waiting=16)) as live:
        yield live


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    """The official client against `live`."""
    url = live.url + "/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


@contextlib.contextmanager
def live_server(
    model_dir: Path,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    options: ServeOptions = SMALL_POOL,
) -> Iterator[LiveServer]:
    """The small pool served on loopback; `wrap` puts an ASGI layer between uvicorn and the app."""
    from kvbank.engine.serve.command import build_server

    stack = build_stack(options, model_dir=model_dir)
    # Generation runs to max_tokens: a random model's end-of-text would make timing-based
    # tests (a long stream to cut, a request that must stay running) depend on luck.
    stack.runner.eos_token_id = -1
    port = free_port()
    http, loop = build_server(stack, "127.0.0.1", port)
    if wrap is not None:
        http.config.app = wrap(cast(ASGIApp, http.config.app))  # build_server gives the app
    loop.start()
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 30
            while not http.started:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            yield LiveServer(url, client, loop)
    finally:
        http.should_exit = True
        thread.join(10)
        loop.stop()
