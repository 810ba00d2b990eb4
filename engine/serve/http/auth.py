"""API keys for /v1/*: `Authorization: Bearer KEY`, checked before a body is read.

/health and /metrics stay open: a kubelet probe and a Prometheus scrape carry no key. A key is
compared in constant time against every configured key, so a timing difference says nothing
about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"


def read_api_keys(path: str) -> frozenset[str]:
    """The keys in `path`, one a line; blank lines and `#` comments ignored. Raises ValueError
    naming the file when it cannot be read or holds no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc})") from exc
    lines = (line.strip() for line in text.splitlines())
    keys = frozenset(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ValueError(
            f"--api-key-file {path} holds no key; write one key a line (# starts a comment)"
        )
    return keys


def _refusal(message: str) -> bytes:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return json.dumps(body).encode()


class RequireApiKey:
    """ASGI layer: a /v1 request without one of `keys` gets 401 and never reaches the app."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = self._bearer(scope)
        if given is None:
            message = "this server needs an API key: send the header 'Authorization: Bearer KEY'"
        elif not self._known(given):
            message = "the API key given is not one this server accepts"
        else:
            await self.app(scope, receive, send)
            return
        body = _refusal(message)
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="kvbank"'),
            ],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _protected(path: str) -> bool:
        return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")

    @staticmethod
    def _bearer(scope: Scope) -> bytes | None:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    return bytes(token.strip())
                return None
        return None

    def _known(self, given: bytes) -> bool:
        # Every key is compared, a match or not, so the time taken does not say which matched.
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        return any(matches)
