"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (with server-sent events),
/v1/models, /health and /metrics, over an `EngineLoop`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbank.engine.engine import RequestRejected
from kvbank.engine.model.textstream import TextStream
from kvbank.engine.model.tokenizer import ChatTemplateError, Tokenizer
from kvbank.engine.request import FinishReason
from kvbank.engine.serve.http.loop import EngineLoop, EngineStopped, QueueFull, Submission
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.engine.serve.http.schema import (
    BadRequest,
    Generation,
    parse_generation,
    parse_messages,
    parse_prompt,
)

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class Served:
    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_seq_len: int
    max_tokens: int  # the server's limit on a request's max_tokens
    # End-of-turn tokens besides the engine's one stop token (Llama 3 lists several in
    # config.json's eos_token_id): every request stops at them.
    extra_stop_ids: tuple[int, ...] = ()


def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(served: Served, loop: EngineLoop, metrics: ServeMetrics) -> FastAPI:
    app = FastAPI(title="kvbank", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = served.tokenizer

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        metrics.requests.labels("invalid").inc()
        return error(400, exc.message, "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(EngineStopped)
    async def engine_stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        return error(503, f"the engine stopped: {exc}", "server_error")

    @app.get("/health")
    async def health() -> Response:
        if not loop.alive:
            return error(503, f"the engine loop stopped: {loop.error}", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "kvbank",
            "max_model_len": served.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request)
        gen = parse_generation(body, served.vocab_size, "max_tokens")
        _check_model(gen)
        prompt = parse_prompt(body, served.vocab_size)
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return await _generate(request, ids, gen, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request)
        gen = parse_generation(body, served.vocab_size, "max_completion_tokens")
        _check_model(gen)
        messages = parse_messages(body)
        try:
            ids = tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from exc
        # The output limit as the client named it: parse_generation reads either.
        legacy = "max_tokens" in body and "max_completion_tokens" not in body
        limit = "max_tokens" if legacy else "max_completion_tokens"
        return await _generate(request, ids, gen, chat=True, max_tokens_param=limit)

    def _check_model(gen: Generation) -> None:
        if gen.max_tokens is not None and gen.max_tokens > served.max_tokens:
            raise BadRequest(
                f"'max_tokens' is {gen.max_tokens}; this server allows at most "
                f"{served.max_tokens} (its --max-tokens)",
                "max_tokens",
            )
        if gen.model is not None and gen.model != served.name:
            raise BadRequest(
                f"model {gen.model!r} is not served here; this server serves {served.name!r}",
                "model",
                "model_not_found",
            )

    async def _generate(
        request: Request,
        ids: list[int],
        gen: Generation,
        chat: bool,
        max_tokens_param: str = "max_tokens",
    ) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        sub = Submission(
            rid, ids, gen.max_tokens, gen.sampling, outputs, asyncio.get_running_loop()
        )
        submitted = time.monotonic()
        try:
            await loop.submit(sub)
        except asyncio.CancelledError:  # the command may be queued already: take it back
            loop.abort(rid)
            raise
        except RequestRejected as exc:
            metrics.requests.labels("rejected").inc()
            # The parameter the refusal names, as the client named it.
            param = max_tokens_param if exc.param == "max_tokens" else exc.param
            return error(400, str(exc), "invalid_request_error", param, "request_too_large")
        except QueueFull as exc:
            metrics.requests.labels("queue_full").inc()
            return error(429, str(exc), "rate_limit_error", None, "queue_full",
                         {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        except (EngineStopped, TimeoutError) as exc:
            return error(503, f"the engine is not running: {exc}", "server_error")
        metrics.prompt_tokens.inc(len(ids))
        text = TextStream(tokenizer, gen.stop, [*gen.stop_token_ids, *served.extra_stop_ids])
        run = Run(rid, outputs, text, loop, metrics, submitted, request)
        usage = {"prompt_tokens": len(ids)}
        if gen.stream:
            return RunStream(run, _sse(run, served.name, chat, gen, usage))
        pieces, reason = [], None
        async for delta, finish in run.deltas():
            pieces.append(delta)
            reason = finish or reason
        if run.disconnected:
            return Response(status_code=499)
        return JSONResponse(_final(rid, served.name, chat, "".join(pieces), reason, run, usage))

    return app


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(
            f"the request body is not valid JSON: {exc}", None, "invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_json")
    return body


_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class Run:
    """One request's token stream: engine outputs -> text deltas, stop handling, abort on leave."""

    def __init__(self, rid: str, outputs: asyncio.Queue[Any], text: TextStream, loop: EngineLoop,
                 metrics: ServeMetrics, submitted: float, request: Request) -> None:  # fmt: skip
        self.rid, self.outputs, self.text, self.loop = rid, outputs, text, loop
        self.metrics, self.submitted, self.request = metrics, submitted, request
        self.completion_tokens = 0
        self.finished = False
        self.closed = False
        self.disconnected = False

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        try:
            while True:
                out = await self._next()
                if out is None:
                    return
                for token in out.new_token_ids:
                    if self.completion_tokens == 0:
                        self.metrics.ttft.observe(time.monotonic() - self.submitted)
                    self.completion_tokens += 1
                    delta = self.text.push(token)
                    if self.text.stopped:  # a stop string or stop token: end it here
                        self._end("stop")
                        yield delta, "stop"
                        return
                    if delta:
                        yield delta, None
                if out.finished:
                    if out.finish_reason is None:
                        raise EngineStopped(out.message or "the engine stopped")
                    self._end(_REASONS.get(out.finish_reason, "stop"), engine_done=True)
                    yield self.text.flush(), _REASONS.get(out.finish_reason, "stop")
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it ended; safe to call again, from any path that lets go."""
        if self.finished or self.closed:
            return
        self.closed = True  # the client left (or the task was cancelled): free its pages
        self.loop.abort(self.rid)
        self.metrics.requests.labels("aborted").inc()

    async def _next(self) -> Any:
        while True:
            try:
                return await asyncio.wait_for(self.outputs.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await self.request.is_disconnected():
                    self.disconnected = True
                    return None

    def _end(self, reason: str, engine_done: bool = False) -> None:
        self.finished = True
        if not engine_done:
            self.loop.abort(self.rid)
        self.metrics.requests.labels("ok").inc()


class RunStream(StreamingResponse):
    """A server-sent-event stream that aborts its request however the response ends.

    The generator's own finally is not enough: Starlette may never resume it. Under ASGI HTTP
    spec 2.4 a send to a client that left raises, and Starlette (1.10) abandons the generator
    where it stands (before its first step, or at the chat role chunk, outside `Run.deltas`),
    so the request would wait for admission, run to its end and only then free its pages. A
    `BackgroundTask` does not cover it either: Starlette skips it when the stream raises.
    """

    def __init__(self, run: Run, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.run, self.events = run, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
            await self.events.aclose()


def _final(rid: str, model: str, chat: bool, text: str, reason: str | None, run: Run,
           usage: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(usage, run),
    }


def _usage(usage: dict[str, int], run: Run) -> dict[str, int]:
    prompt = usage["prompt_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": run.completion_tokens,
            "total_tokens": prompt + run.completion_tokens}  # fmt: skip


async def _sse(run: Run, model: str, chat: bool, gen: Generation,
               usage: dict[str, int]) -> AsyncGenerator[str, None]:  # fmt: skip
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                {"content": delta} if delta else {})  # fmt: skip
        else:
            choice["text"] = delta or ""
        body = {"id": run.rid, "object": kind, "created": created, "model": model,
                "choices": [choice]}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield chunk(None, None, role=True)
    try:
        async for delta, reason in run.deltas():
            if delta or reason:
                yield chunk(delta, reason)
    except EngineStopped as exc:
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
    if gen.include_usage:
        body = {"id": run.rid, "object": kind, "created": created, "model": model,
                "choices": [], "usage": _usage(usage, run)}  # fmt: skip
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
