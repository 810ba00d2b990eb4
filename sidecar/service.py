"""The typed gRPC servicer: turns calls into `AdmissionState` operations and errors into the
status codes the contract promises.

    InvalidPages (negative, absurd, malformed)   -> INVALID_ARGUMENT
    UnknownRequest                               -> NOT_FOUND
    DuplicateRequest                             -> ALREADY_EXISTS
    out-of-order sequence numbers, wrong pool or policy -> FAILED_PRECONDITION
    a session this sidecar does not hold         -> ABORTED (open a new session)
    a report that breaks the safe-state check    -> INTERNAL (and counted)
    a submit past the queue's --max-waiting      -> RESOURCE_EXHAUSTED

UNAUTHENTICATED (a wrong token) comes from `auth.py`; RESOURCE_EXHAUSTED also comes from gRPC's
own message-size limit (an oversized message). A failed call changes nothing: the state commits
a report only when every event in it succeeded. An InvalidPages that names its field sends it as
the `kvbank-field` trailing metadata; a message is cut at MAX_DETAIL characters, far inside the
16 KiB a client takes in a status (past it the client sees RESOURCE_EXHAUSTED instead).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

import grpc

from kvbank.ledger import DuplicateRequest, InvalidPages, InvariantBreach, UnknownRequest
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.decision_log import LogGap
from kvbank.sidecar.limits import check_id
from kvbank.sidecar.reports import QueueFull
from kvbank.sidecar.state import (
    AdmissionState,
    OutOfOrder,
    PolicyMismatch,
    PoolMismatch,
    SessionGone,
)

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvariantBreach, grpc.StatusCode.INTERNAL),  # before InvalidPages: both are ledger errors
    (InvalidPages, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (OutOfOrder, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (PolicyMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (LogGap, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionGone, grpc.StatusCode.ABORTED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
)
_EXPECTED = tuple(kind for kind, _ in _CODES)
_R = TypeVar("_R")
MAX_DETAIL = 2000  # characters of an error message sent; each quotes its values bounded already


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    code = next(c for kind, c in _CODES if isinstance(exc, kind))
    details = str(exc)
    if len(details) > MAX_DETAIL:
        details = details[: MAX_DETAIL - 3] + "..."
    field = exc.field if isinstance(exc, InvalidPages) else ""
    await context.abort(code, details, (("kvbank-field", field),) if field else ())
    raise AssertionError("unreachable: abort raises")  # for type checkers


class AdmissionService(pb_grpc.AdmissionServicer):
    def __init__(self, state: AdmissionState) -> None:
        self.state = state
        self._log_changed = asyncio.Event()
        state.log.on_append = self._wake_followers

    def _wake_followers(self) -> None:
        self._log_changed.set()
        self._log_changed = asyncio.Event()

    async def _call(self, fn: Callable[[], _R], context: grpc.aio.ServicerContext) -> _R:
        try:
            return fn()
        except _EXPECTED as exc:
            if isinstance(exc, InvariantBreach):
                self.state.metrics.breaches.inc()
            await _abort(context, exc)

    async def OpenSession(  # gRPC method names
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionReply:
        return await self._call(lambda: self.state.open_session(request), context)

    async def Report(
        self, request: pb.ReportRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportReply:
        started = time.perf_counter()
        reply = await self._call(lambda: self.state.report(request), context)
        self.state.metrics.decision_latency.observe(time.perf_counter() - started)
        return reply

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckReply:
        log = self.state.log
        await self._call(lambda: log.ack(_follower_id(request.follower_id), request.seq), context)
        return pb.AckReply(log_first_seq=log.first_seq)

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        return self.state.status()

    async def Follow(
        self, request: pb.FollowRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Decision]:
        """Stream decisions from `from_seq`, then each new one as it is made. A follower behind
        the log's start gets FAILED_PRECONDITION (it cannot catch up and must restart)."""
        log = self.state.log
        seq = request.from_seq
        await self._call(lambda: _check_from(request, log.first_seq, log.next_seq), context)
        log.seen(request.follower_id, seq)
        generation = log.generation
        while True:
            while seq < log.next_seq:
                entry = await self._call(functools.partial(log.get, seq), context)
                yield entry
                seq += 1
            changed = self._log_changed
            await changed.wait()
            if log.generation != generation:
                # A new engine session renumbered the log. The follower reconnects from its own
                # next decision; the new log either continues there (the engine re-opened after
                # a restart or a lapsed lease) or refuses it (a different engine).
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the engine session was re-opened with the log at {log.first_seq}; "
                    f"reconnect from decision {seq}",
                )


def _follower_id(fid: str) -> str:
    if not fid:
        raise InvalidPages("follower_id must be a non-empty string", "follower_id")
    check_id(fid, "follower_id")
    return fid


def _check_from(request: pb.FollowRequest, first: int, next_seq: int) -> None:
    _follower_id(request.follower_id)
    if request.from_seq < 0:
        raise InvalidPages(f"from_seq must not be negative, got {request.from_seq}", "from_seq")
    if not first <= request.from_seq <= next_seq:
        raise LogGap(
            f"the log holds decisions {first}..{next_seq - 1}; a follower cannot start at "
            f"{request.from_seq} (behind: it must restart with its rank; ahead: it counts "
            "decisions this sidecar never made)"
        )
