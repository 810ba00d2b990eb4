"""Errors a request earns before it reaches the engine, in OpenAI's error format."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class BadRequest(Exception):
    """Maps to an HTTP error (400 unless said) in OpenAI's error format, with the offending
    field as `param`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 status: int = 400) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    # Whatever a message quotes must encode: a lone surrogate would fail the response itself.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = None if param is None else field_name(param, 256)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_name(key: str, limit: int = 64) -> str:
    """A client's field name as an error's `param`: cut to `limit` characters, and a lone
    UTF-16 surrogate (which JSON may carry and UTF-8 cannot) written as its escape."""
    name = key if len(key) <= limit else key[:limit] + "..."
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: object, limit: int = 64) -> str:
    """A client's value quoted in a message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
