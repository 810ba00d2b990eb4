"""Deadlines and bounds for HTTP connections: a client must send a request's headers, and then its
body, within a bounded time, must read its response rather than stall it, and may not hold more
connections than the server can give descriptors to.

uvicorn times out only an idle keep-alive connection after a response; a client that connects and
sends half a request line, or headers and half a body, holds its socket (and, mid-body, a task)
forever. `DeadlineProtocol` wraps uvicorn's h11 protocol, unchanged, and reads h11's view of the
client (`their_state`) as the request goes: IDLE while headers are awaited, SEND_BODY while the
body is, DONE once the request is in (the response may then take as long as generation takes).
A client that stays in the first two phases past their deadline gets 408 and is disconnected;
the handler then sees a disconnect, as for any client that leaves.

A client that stops reading its response fills the socket's buffers, and the transport then
pauses writing: uvicorn waits for it to drain, with no limit, holding the connection and a
stream's request (its pages) with it. Writing paused for longer than the write deadline aborts
the connection; the handler sees a disconnect and the request is aborted. A chunked body whose
chunk declares more than the body limit gets 413 at once (the app's own check would only see
the bytes as they came, and a chunk of 2**48 bytes never comes). A connection over the cap gets
503 and is closed before it reads anything (kvbank.engine.serve.http.limits says why).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import h11
from h11._readers import ChunkedReader  # its declared chunk size; h11 exposes no other way
from uvicorn.protocols.http.h11_impl import H11Protocol

REPLY = (
    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


@dataclass(frozen=True)
class ConnectionLimits:
    headers_s: float  # from connection (or the previous response) to the end of the headers
    body_s: float  # from the end of the headers to the end of the body
    write_s: float = 30.0  # how long a response may wait on a client that does not read it
    max_body_bytes: int = 2 << 20  # a chunk declaring more is refused before it arrives
    max_connections: int | None = None  # None: no cap

    @property
    def tick_s(self) -> float:
        """How often a connection's phase is looked at: a deadline fires at most this late."""
        return min(1.0, max(0.05, min(self.headers_s, self.body_s, self.write_s) / 4))


def _error(status: bytes, message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    return REPLY % (status, len(body), body)


class DeadlineProtocol(asyncio.Protocol):
    """uvicorn's H11Protocol, with a deadline on each phase of reading a request."""

    def __init__(self, limits: ConnectionLimits, **uvicorn_args: Any) -> None:
        self.inner = H11Protocol(**uvicorn_args)
        self.limits = limits
        self.loop = self.inner.loop
        self.transport: asyncio.Transport | None = None
        self.phase: str | None = None
        self.since = 0.0
        self.started = False  # some bytes of the awaited request arrived
        self.timer: asyncio.TimerHandle | None = None
        self.write_paused_at: float | None = None  # since when the client has not read

    @classmethod
    def factory(cls, limits: ConnectionLimits) -> Any:
        """A protocol class for uvicorn's Config(http=...): it calls it with its own arguments."""

        def make(**uvicorn_args: Any) -> DeadlineProtocol:
            return cls(limits, **uvicorn_args)

        return make

    # ---- asyncio.Protocol, passed through ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.inner.connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.inner.connections) > cap:
            message = (
                f"this server holds its limit of {cap} connections (its --max-connections); "
                "retry shortly, or reuse a connection"
            )
            transport.write(_error(b"503 Service Unavailable", message, "too_many_connections"))
            transport.close()
            return
        self._observe()
        self.timer = self.loop.call_later(self.limits.tick_s, self._tick)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        self._observe()
        self.started = True
        reader = getattr(self.inner.conn, "_reader", None)
        declared = getattr(reader, "_bytes_in_chunk", 0) if isinstance(reader, ChunkedReader) else 0
        limit = self.limits.max_body_bytes
        if declared > limit and self.transport is not None and not self.transport.is_closing():
            message = (
                f"a chunk of the request body has {declared} bytes still to come, over this "
                f"server's limit of {limit} bytes for the whole body (its --max-body-bytes); "
                "send a shorter prompt"
            )
            self._refuse(self.transport, b"413 Content Too Large", message, "request_too_large")

    def eof_received(self) -> None:
        self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.write_paused_at = self.loop.time()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.write_paused_at = None
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
        now = self.loop.time()
        stalled = self.write_paused_at
        if stalled is not None and now - stalled > self.limits.write_s:
            # Nothing more can be written, so nothing can be said: drop the connection and
            # what is buffered for it (close() would wait for the buffer to drain).
            transport.abort()
            return
        limit = {"headers": self.limits.headers_s, "body": self.limits.body_s}.get(self.phase or "")
        if limit is not None and now - self.since > limit:
            self._expire(transport, limit)
            return
        self.timer = self.loop.call_later(self.limits.tick_s, self._tick)

    def _expire(self, transport: asyncio.Transport, limit: float) -> None:
        # A 408 goes out only for a request begun (an idle keep-alive connection is just
        # closed: its client may be about to reuse it) and while no response has started.
        begun = self.phase == "body" or self.started
        if begun:
            flag = "--header-timeout-s" if self.phase == "headers" else "--body-timeout-s"
            message = (
                f"the request's {self.phase} did not arrive within {limit:g} s (the server's "
                f"{flag})"
            )
            self._refuse(transport, b"408 Request Timeout", message, "request_timeout")
        else:
            transport.close()

    def _refuse(self, transport: asyncio.Transport, status: bytes, message: str,
                code: str) -> None:  # fmt: skip
        """Answer `status` and close, if no response has started (else just close)."""
        if self.inner.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            transport.write(_error(status, message, code))
        transport.close()
