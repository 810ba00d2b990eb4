"""The one module that talks to a sidecar over gRPC. The engine's backend, follower ranks,
`kvbank status` and the operator all call it; nothing else imports grpc to reach a peer.

Policies, the same for every caller:

- Deadlines: every unary call gets `deadline_s` (default 2 s); the follow stream gets
  `follow_deadline_s` (default 60 s), after which the follower simply resumes from its
  sequence number, so no stream can hang on a silent peer.
- UNAVAILABLE (the sidecar restarting, a connection reset) and DEADLINE_EXCEEDED are retried
  with exponential backoff (50 ms doubling to 1 s) until `retry_budget_s` (default 10 s; a
  call may pass its own, as the serving engine's reports do) is spent, then
  `SidecarUnavailable`. Retrying is safe for every call: reports carry their
  `report_seq` and the sidecar answers a repeated one with its first reply; acks and status
  are idempotent; opening a session twice only replaces the first one.
- ABORTED means the sidecar does not hold the caller's session (it restarted or the lease
  expired): `SessionLost`, never retried here; the engine's backend re-opens and re-registers.
- Every other status is the caller's bug or bad input: `SidecarError` with the code name and the
  server's message, never retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.auth import bearer

_T = TypeVar("_T")
_R = TypeVar("_R")
RECONNECT_BACKOFF_MS = (100, 2000)  # the channel's first and longest wait between connects
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SidecarError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SidecarUnavailable(SidecarError):
    """The sidecar did not answer within the retry budget."""


class SessionLost(SidecarError):
    """The sidecar no longer holds this engine's session."""


@dataclass(frozen=True)
class PoolStatus:
    """A sidecar's live pool figures, for the operator's status and `kvbank status`."""

    session: int
    total_pages: int
    usable_pages: int
    free: int
    evictable: int
    reserved: int
    held: int
    outstanding: int
    waiting: int
    running: int
    next_seq: int

    @property
    def supply(self) -> int:
        return self.free + self.evictable


def _error(exc: grpc.RpcError) -> SidecarError:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    kind = SidecarError
    if code in _RETRYABLE:
        kind = SidecarUnavailable
    elif code == grpc.StatusCode.ABORTED:
        kind = SessionLost
    return kind(code.name, details)


class SidecarClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca: bytes | None = None,
        tls_server_name: str | None = None,
        deadline_s: float = 2.0,
        follow_deadline_s: float = 60.0,
        retry_budget_s: float = 10.0,
        max_message_bytes: int = 1 << 20,
    ) -> None:
        self.address = address
        self.deadline_s = deadline_s
        self.follow_deadline_s = follow_deadline_s
        self.retry_budget_s = retry_budget_s
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC's own reconnect backoff grows to 120 s: a sidecar back after a long outage
            # would wait that long for the channel to try again, whatever the caller's retries.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]
        if tls_ca is not None:
            # The certificate must name the address's host, or `tls_server_name` when given.
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._metadata = bearer(token) if token else ()
        self._stub = pb_grpc.AdmissionStub(self._channel)
        self._sender: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
        self._channel.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the policy ----------------------------------------------------------------------------

    def _retrying(self, call: Callable[[], _T], budget_s: float | None = None) -> _T:
        give_up = time.monotonic() + (self.retry_budget_s if budget_s is None else budget_s)
        backoff = 0.05
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                err = _error(exc)
                if not isinstance(err, SidecarUnavailable) or time.monotonic() >= give_up:
                    raise err from None
            time.sleep(min(backoff, max(0.0, give_up - time.monotonic())))
            backoff = min(backoff * 2, 1.0)

    def _unary(
        self, method: Callable[..., _T], request: object, budget_s: float | None = None
    ) -> _T:
        return self._retrying(
            lambda: method(request, timeout=self.deadline_s, metadata=self._metadata), budget_s
        )

    # ---- calls ---------------------------------------------------------------------------------

    def open_session(
        self, request: pb.OpenSessionRequest, budget_s: float | None = None
    ) -> pb.OpenSessionReply:
        return self._unary(self._stub.OpenSession, request, budget_s)

    def report(self, request: pb.ReportRequest, budget_s: float | None = None) -> pb.ReportReply:
        return self._unary(self._stub.Report, request, budget_s)

    def report_async(
        self, make: Callable[[], pb.ReportRequest], budget_s: float | None = None
    ) -> Future[pb.ReportReply]:
        """Send a report without waiting (the serving engine's step loop never blocks). One
        long-lived sender thread makes the message (`make()`) and the call with the same
        policy as `report` (retries, and a failure ends as one of this module's errors): a gRPC
        future would start a thread per call, about 1.6 ms of the step on a small machine.
        `budget_s` replaces the retry budget for this call (a serving engine wants to know
        soon)."""
        return self._send(lambda request, budget: self.report(request(), budget), make, budget_s)

    def open_session_async(
        self, request: pb.OpenSessionRequest, budget_s: float | None = None
    ) -> Future[pb.OpenSessionReply]:
        """Open a session without waiting, on the same sender thread as the reports, so a
        session is never opened beside a report of the session it replaces."""
        return self._send(self.open_session, request, budget_s)

    def _send(
        self, call: Callable[[_R, float | None], _T], request: _R, budget_s: float | None
    ) -> Future[_T]:
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="kvbank-report")
        return self._sender.submit(call, request, budget_s)

    def ack(self, follower_id: str, seq: int) -> int:
        """Returns the oldest sequence number the log still holds."""
        reply = self._unary(self._stub.Ack, pb.AckRequest(follower_id=follower_id, seq=seq))
        return reply.log_first_seq

    def status_reply(self) -> pb.StatusReply:
        return self._unary(self._stub.Status, pb.StatusRequest())

    def status(self) -> PoolStatus:
        r = self.status_reply()
        p = r.pool
        return PoolStatus(
            session=r.session,
            total_pages=p.total_pages,
            usable_pages=p.usable_pages,
            free=p.free,
            evictable=p.evictable,
            reserved=p.reserved,
            held=p.held,
            outstanding=p.outstanding,
            waiting=len(r.waiting),
            running=len(r.running),
            next_seq=r.next_seq,
        )

    def follow(self, follower_id: str, from_seq: int) -> Iterator[pb.Decision]:
        """Decisions from `from_seq` on, in order, until the stream's deadline or an error
        (raised as this module's errors; the caller resumes from its own sequence number)."""
        stream = self._stub.Follow(
            pb.FollowRequest(follower_id=follower_id, from_seq=from_seq),
            timeout=self.follow_deadline_s,
            metadata=self._metadata,
        )
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            stream.cancel()


def unreachable_message(
    address: str, exc: SidecarError, token: str | None, tls_ca: bytes | None
) -> str:
    """Why the sidecar at `address` did not answer, in the engine's flags."""
    if exc.code == "UNAUTHENTICATED":
        given = "the token in --sidecar-token-file" if token else "no token"
        return (
            f"the sidecar at {address} refused {given} ({exc.message}); give "
            f"--sidecar-token-file the file the sidecar reads with --token-file"
        )
    if exc.code == "UNAVAILABLE":
        tls = (
            "over TLS with --sidecar-ca-file: is its certificate signed by that CA, for that "
            "name (--sidecar-tls-server-name)?"
            if tls_ca
            else "in plaintext: does it serve TLS (then give --sidecar-ca-file)?"
        )
        return f"cannot reach the sidecar at {address} ({exc.message}); is it running, and {tls}"
    return f"the sidecar at {address} answered {exc}"


def routing_channel(
    address: str, ca_pem: bytes | None = None, tls_name: str | None = None
) -> tuple[grpc.aio.Channel, pb_grpc.RoutingStub]:
    """An asyncio channel to a sidecar's Routing service and its stub, for an endpoint picker:
    TLS when `ca_pem` is given, checked against `tls_name` when the address is not the name
    the certificate holds. Opened here, beside the engine's client, like every channel to a
    sidecar."""
    if ca_pem is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        channel = grpc.aio.secure_channel(address, creds, options=options)
    else:
        channel = grpc.aio.insecure_channel(address)
    return channel, pb_grpc.RoutingStub(channel)
