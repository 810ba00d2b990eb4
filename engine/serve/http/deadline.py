"""Read deadlines for HTTP connections: a client must send a request's headers, and then its
body, within a bounded time, or its connection is closed.

uvicorn times out only an idle keep-alive connection after a response; a client that connects and
sends half a request line, or headers and half a body, holds its socket (and, mid-body, a task)
forever. `DeadlineProtocol` wraps uvicorn's h11 protocol, unchanged, and reads h11's view of the
client (`their_state`) as the request goes: IDLE while headers are awaited, SEND_BODY while the
body is, DONE once the request is in (the response may then take as long as generation takes).
A client that stays in the first two phases past their deadline gets 408 and is disconnected;
the handler then sees a disconnect, as for any client that leaves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


@dataclass(frozen=True)
class ReadDeadlines:
    headers_s: float  # from connection (or the previous response) to the end of the headers
    body_s: float  # from the end of the headers to the end of the body

    @property
    def tick_s(self) -> float:
        """How often a connection's phase is looked at: a deadline fires at most this late."""
        return min(1.0, max(0.05, min(self.headers_s, self.body_s) / 4))


class DeadlineProtocol(asyncio.Protocol):
    """uvicorn's H11Protocol, with a deadline on each phase of reading a request."""

    def __init__(self, deadlines: ReadDeadlines, **uvicorn_args: Any) -> None:
        self.inner = H11Protocol(**uvicorn_args)
        self.deadlines = deadlines
        self.loop = self.inner.loop
        self.transport: asyncio.Transport | None = None
        self.phase: str | None = None
        self.since = 0.0
        self.started = False  # some bytes of the awaited request arrived
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    def factory(cls, deadlines: ReadDeadlines) -> Any:
        """A protocol class for uvicorn's Config(http=...): it calls it with its own arguments."""

        def make(**uvicorn_args: Any) -> DeadlineProtocol:
            return cls(deadlines, **uvicorn_args)

        return make

    # ---- asyncio.Protocol, passed through ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.inner.connection_made(transport)
        self._observe()
        self.timer = self.loop.call_later(self.deadlines.tick_s, self._tick)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        self._observe()
        self.started = True

    def eof_received(self) -> None:
        self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # ---- the deadlines -------------------------------------------------------------------------

    def _observe(self) -> None:
        state = self.inner.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase != self.phase:
            self.phase, self.since, self.started = phase, self.loop.time(), False

    def _tick(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._observe()
        limit = {"headers": self.deadlines.headers_s, "body": self.deadlines.body_s}.get(
            self.phase or ""
        )
        if limit is not None and self.loop.time() - self.since > limit:
            self._expire(transport, limit)
            return
        self.timer = self.loop.call_later(self.deadlines.tick_s, self._tick)

    def _expire(self, transport: asyncio.Transport, limit: float) -> None:
        # A 408 goes out only for a request begun (an idle keep-alive connection is just
        # closed: its client may be about to reuse it) and while no response has started.
        begun = self.phase == "body" or self.started
        if begun and self.inner.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            flag = "--header-timeout-s" if self.phase == "headers" else "--body-timeout-s"
            message = (
                f'{{"error": {{"message": "the request\'s {self.phase} did not arrive within '
                f'{limit:g} s (the server\'s {flag})", "type": "invalid_request_error", '
                f'"param": null, "code": "request_timeout"}}}}'
            ).encode()
            transport.write(REQUEST_TIMEOUT % (len(message), message))
        transport.close()
