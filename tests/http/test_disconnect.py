"""A client that leaves before its first chunk: its request is aborted while it waits, so a queue
of clients that timed out never holds the pool.

The window is the one between the server reading the request and the response starting: the
handler waits there for the engine thread to queue the request. The test widens it at will by
parking the engine thread on a gate (`EngineLoop.call` runs a function between steps), so the
client's close lands inside it every time instead of by luck.

Uvicorn speaks ASGI HTTP spec 2.3: Starlette then watches for the disconnect itself and cancels
the stream inside `Run.deltas`, whose finally aborts. A server speaking spec 2.4 makes `send`
raise instead, and Starlette never runs the event generator at all; `Spec24` plays that server
over the same uvicorn, so both ways of leaving are tried.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import anyio
import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.http.conftest import LiveServer, live_server

ABORTED = 'kvbank_requests_total{outcome="aborted"}'
FINISHED = 'kvbank_requests_total{outcome="ok"}'
# The pool holds 63 pages: 4 prompt tokens + 1000 max_tokens take all of them, so every other
# request waits behind this one until it ends.
POOL_HOLDER = {"prompt": [0, 11, 12, 13], "max_tokens": 1000, "temperature": 0, "stream": True}
LEAVER = {"max_tokens": 600, "temperature": 0}
CASES: dict[str, tuple[str, dict[str, object], bool]] = {
    "chat-stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
        True,
    ),
    "completion-stream": ("/v1/completions", {"prompt": "The page cache"}, True),
    "completion": ("/v1/completions", {"prompt": "The page cache"}, False),
}


class Spec24:
    """Serve the app as an ASGI HTTP 2.4 server does: a send to a client that left raises
    OSError (the spec's words) instead of being dropped as uvicorn's 2.3 does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}
        gone = False
        body_read = False

        async def watched_receive() -> Message:
            nonlocal gone, body_read
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            body_read = body_read or not message.get("more_body", False)
            return message

        async def raising_send(message: Message) -> None:
            nonlocal gone
            if body_read and not gone:  # look without waiting, as Request.is_disconnected does
                with anyio.CancelScope() as peek:
                    peek.cancel()
                    gone = (await receive())["type"] == "http.disconnect"
            if gone:
                raise OSError("the client closed the connection")
            await send(message)

        await self.app(scope, watched_receive, raising_send)


@pytest.fixture(scope="module")
def server_24(builtin_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(builtin_model_dir, Spec24) as live:
        yield live


def _send_raw(url: str, path: str, body: dict[str, object]) -> socket.socket:
    """Send one whole HTTP request and read nothing: the caller closes the socket."""
    address = urlparse(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((address.hostname, address.port), timeout=5)
    sock.sendall(head.encode() + payload)
    return sock


def _park_engine(server: LiveServer) -> threading.Event:
    """Hold the engine thread between steps until the returned event is set (at most 10 s)."""
    parked, release = threading.Event(), threading.Event()

    def gate() -> None:
        parked.set()
        release.wait(10)

    server.loop.call(gate)
    assert parked.wait(5), "the engine thread never reached the gate"
    return release


def _wait_queued(server: LiveServer, commands: int) -> None:
    """Wait until the handler's submission sits in the engine's command queue."""
    deadline = time.monotonic() + 5
    while server.loop._commands.qsize() < commands:  # the one sign the body was read
        assert time.monotonic() < deadline, "the server never submitted the request"
        time.sleep(0.01)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_before_its_first_chunk_is_aborted_while_it_waits(
    request: pytest.FixtureRequest, spec: str, case: str
) -> None:
    server: LiveServer = request.getfixturevalue("server" if spec == "2.3" else "server_24")
    path, prompt, stream = CASES[case]
    before = server.settled()
    with (
        httpx.Client(base_url=server.url, timeout=30) as holder_client,
        holder_client.stream("POST", "/v1/completions", json=POOL_HOLDER) as holder,
    ):
        lines = holder.iter_lines()
        assert next(lines).startswith("data: ")  # the pool is held: the next request waits
        release = _park_engine(server)
        try:
            leaver = _send_raw(server.url, path, {**LEAVER, **prompt, "stream": stream})
            _wait_queued(server, 1)
            leaver.close()  # gone before the server could answer anything
            time.sleep(0.3)  # the server's event loop notices the closed connection
        finally:
            release.set()
        # Aborted while it waits: the queue empties with the holder still running, long before
        # the holder's 1000 tokens and then its own 600 could have been generated.
        figures = server.wait_for(
            within=3,
            kvbank_running_requests=1,
            kvbank_waiting_requests=0,
            **{ABORTED: before.get(ABORTED, 0.0) + 1},
        )
        # Neither ended: the leaver never ran, and the holder is still generating.
        assert figures.get(FINISHED, 0.0) == before.get(FINISHED, 0.0)
    # The holder is cut too: nothing is left of either request.
    figures = server.wait_for(
        within=5,
        kvbank_running_requests=0,
        kvbank_waiting_requests=0,
        kvbank_pool_held_pages=0,
        kvbank_outstanding_pages=0,
        **{ABORTED: before.get(ABORTED, 0.0) + 2},
    )
    assert figures["kvbank_pool_free_pages"] + figures["kvbank_pool_evictable_pages"] == 63


@pytest.mark.timeout(20)
def test_a_stream_cut_mid_way_is_aborted_when_send_raises(server_24: LiveServer) -> None:
    """Under spec 2.4 Starlette learns of the leave only from a failed send and drops the
    generator inside a yield; the request is still aborted within seconds (the response closes
    it; before that only the generator's collection did, whenever that came)."""
    before = server_24.settled()
    with (
        httpx.Client(base_url=server_24.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=POOL_HOLDER) as stream,
    ):
        assert next(stream.iter_lines()).startswith("data: ")
    figures = server_24.wait_for(
        within=3,
        kvbank_running_requests=0,
        kvbank_pool_held_pages=0,
        kvbank_outstanding_pages=0,
        **{ABORTED: before.get(ABORTED, 0.0) + 1},
    )
    assert figures.get(FINISHED, 0.0) == before.get(FINISHED, 0.0)
