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
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def shown(value: object, limit: int = 64) -> str:
    """A client's value quoted in a message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
