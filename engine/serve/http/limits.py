"""Descriptors: how many connections the server holds, and what it says when it runs out.

Every connection is a file descriptor, and so is every model file, tokenizer thread and gRPC
channel. The soft open-files limit a shell hands a process (1,024 is common) is far below the
hard limit the system allows, so `kvbank serve` raises the soft limit to the hard one at start
and caps its connections below it, keeping `RESERVED_FDS` for everything else: a connection over
the cap gets 503 and is closed at once (kvbank.engine.serve.http.deadline), so a flood of idle
sockets never takes the descriptor a model file or the sidecar needs.

If accepting fails anyway (the system-wide table is full, say), asyncio logs a traceback for each
failure and retries a second later, which under a flood is a traceback a second for as long as
it lasts; `AcceptErrorLog` logs one line per interval with the count instead.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("kvbank.serve")

RESERVED_FDS = 256  # model files, threads, the sidecar channel, /proc reads, logs
MAX_SOFT_LIMIT = 1 << 20  # a hard limit of "unlimited" cannot be set as a soft one
ACCEPT_MESSAGE = "socket.accept() out of system resource"


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a container may forbid it: serve with what is
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
            return soft
        log.info("raised the open-files soft limit from %d to %d", soft, target)
        return target
    return MAX_SOFT_LIMIT if soft == resource.RLIM_INFINITY else soft


def connection_cap(open_files: int) -> int:
    """Connections to hold under `open_files` descriptors: all but RESERVED_FDS, and never
    more than half of a small limit."""
    if open_files >= 2 * RESERVED_FDS:
        return open_files - RESERVED_FDS
    return max(1, open_files // 2)


class AcceptErrorLog:
    """An event loop exception handler: a failed accept is logged as one line, at most once
    per `interval_s`, with how many failed since; anything else goes to the default handler."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.last_logged: float | None = None
        self.failed = 0  # accepts that failed since the last line

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_MESSAGE:
            loop.default_exception_handler(context)
            return
        self.failed += 1
        now = self.clock()
        if self.last_logged is not None and now - self.last_logged < self.interval_s:
            return
        exc = context.get("exception")
        log.error(
            "accepting a connection failed (%s), %d time(s) since the last report; asyncio "
            "retries each second, and this is reported at most every %g s. Raise the "
            "open-files limit (ulimit -n) or lower --max-connections",
            exc, self.failed, self.interval_s,
        )  # fmt: skip
        self.last_logged, self.failed = now, 0


class Server(uvicorn.Server):
    """uvicorn's server, with failed accepts logged by `AcceptErrorLog`."""

    async def serve(self, sockets: Any = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().serve(sockets)
