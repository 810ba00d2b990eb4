"""The shared-token check for followers in other pods: every call but the health service must
carry `authorization: Bearer <token>`. Health stays open because the kubelet's gRPC probe sends
no metadata; it reveals nothing but serving or not."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
STREAMS = ("/Follow", "/Watch")  # server-streaming methods: denied with a stream handler
METADATA_KEY = "authorization"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the shared token must not be empty")
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong sidecar token: send 'authorization: Bearer <token>' with the "
                "token this sidecar was started with (--token-file)",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent_bytes, self._expected):
            return await continuation(details)
        return self._deny_stream if details.method.endswith(STREAMS) else self._deny_unary
