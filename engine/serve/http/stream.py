"""One request's token stream turned into OpenAI response bodies: whole, or server-sent events.

A completion request may carry several prompts; each is its own engine request (a `Run`) and its
own choice, by index. A stream interleaves their chunks as tokens come.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbank.engine.model.textstream import TextStream
from kvbank.engine.request import FinishReason
from kvbank.engine.runner import TokenLogprob
from kvbank.engine.serve.http.loop import EngineLoop, EngineStopped
from kvbank.engine.serve.http.metrics import ServeMetrics

log = logging.getLogger("kvbank.serve")

DISCONNECT_POLL_S = 0.5
_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}

TokenText = Callable[[int], str]  # a token id's own text, for logprobs


class RequestFailed(Exception):
    """The engine ended this request with an error (its row could not be sampled): never a
    finish_reason, which would claim an output the request did not reach. `param` names the
    request field behind it, when one is."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return 400 if self.param is not None else 500

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.param is not None else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": "generation_failed"}}  # fmt: skip


@dataclass
class Piece:
    """What one step of a run adds to its choice: text, the tokens' logprobs, and the finish."""

    text: str
    finish: str | None = None
    logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)


class Run:
    """One engine request: engine outputs -> text pieces, stop handling, abort on leave."""

    def __init__(self, rid: str, outputs: asyncio.Queue[Any], text: TextStream, loop: EngineLoop,
                 metrics: ServeMetrics, submitted: float, request: Request,
                 prompt_tokens: int) -> None:  # fmt: skip
        self.rid, self.outputs, self.text, self.loop = rid, outputs, text, loop
        self.metrics, self.submitted, self.request = metrics, submitted, request
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.first_token_at = 0.0
        self.finished = False
        self.closed = False
        self.disconnected = False

    async def pieces(self) -> AsyncIterator[Piece]:
        logprobs: list[tuple[int, TokenLogprob]] = []
        try:
            while True:
                out = await self._next()
                if out is None:
                    return
                for i, token in enumerate(out.new_token_ids):
                    self._count_token()
                    if i < len(out.logprobs):
                        logprobs.append((token, out.logprobs[i]))
                    delta = self.text.push(token)
                    if self.text.stopped:  # a stop string or stop token: end it here
                        self._end("stop")
                        yield Piece(delta, "stop", logprobs)
                        return
                    if delta:
                        yield Piece(delta, None, logprobs)
                        logprobs = []
                if out.finished:
                    if out.finish_reason is None:
                        raise EngineStopped(out.message or "the engine stopped")
                    if out.finish_reason is FinishReason.ERROR:
                        self.finished = True  # the engine ended it: nothing to abort
                        self.metrics.requests.labels("failed").inc()
                        raise RequestFailed(out.message, out.param)
                    reason = _REASONS.get(out.finish_reason, "stop")
                    self._end(reason, engine_done=True)
                    yield Piece(self.text.flush(), reason, logprobs)
                    return
        finally:
            self.close()

    def _count_token(self) -> None:
        now = time.monotonic()
        if self.completion_tokens == 0:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.submitted)
        self.completion_tokens += 1

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
        if self.closed:
            return  # the client left first: aborted, counted once as such
        self.finished = True
        if not engine_done:
            self.loop.abort(self.rid)
        self.metrics.requests.labels("ok").inc()
        if self.completion_tokens > 1:
            decode_s = time.monotonic() - self.first_token_at
            self.metrics.tpot.observe(decode_s / (self.completion_tokens - 1))


@dataclass(frozen=True)
class Shape:
    """How the choices of one response read: the route, the id, the echoed prompts."""

    rid: str
    model: str
    chat: bool
    token_text: TokenText
    echo: Sequence[str] = ()  # per choice, the prompt text to put first
    include_usage: bool = False
    continuous_usage: bool = False
    service_tier: str = "default"  # the tier the request got, in every body (tiers.py)

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def logprobs(self, entries: list[tuple[int, TokenLogprob]], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in entries], "refusal": None}
        tokens = [self.token_text(t) for t, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [self._top_by_text(lp) for _, lp in entries],
            "text_offset": offsets,
        }

    def _top_by_text(self, lp: TokenLogprob) -> dict[str, float]:
        # Keyed by text, as the legacy format is: two tokens that read alike (both halves of a
        # character read U+FFFD) keep the likelier one's figure.
        top: dict[str, float] = {}
        for token, value in lp.top:
            top.setdefault(self.token_text(token), value)
        return top

    def _chat_entry(self, token: int, lp: TokenLogprob) -> dict[str, Any]:
        def one(t: int, value: float) -> dict[str, Any]:
            text = self.token_text(t)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {**one(token, lp.logprob), "top_logprobs": [one(a, v) for a, v in lp.top]}


def usage(runs: Sequence[Run]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in runs)
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


async def whole(shape: Shape, runs: Sequence[Run], want_logprobs: bool) -> dict[str, Any] | None:
    """The unstreamed body; None when the client left before the end."""

    async def collect(index: int, run: Run) -> dict[str, Any]:
        texts, entries, reason = [], [], None
        async for piece in run.pieces():
            texts.append(piece.text)
            entries.extend(piece.logprobs)
            reason = piece.finish or reason
        prefix = shape.echo[index] if shape.echo else ""
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = shape.logprobs(entries, len(prefix))
        if shape.chat:
            choice["message"] = {"role": "assistant", "content": "".join(texts)}
        else:
            choice["text"] = prefix + "".join(texts)
        return choice

    choices = await asyncio.gather(*(collect(i, r) for i, r in enumerate(runs)))
    if any(r.disconnected for r in runs):
        return None
    return {"id": shape.rid, "object": shape.kind, "created": int(time.time()),
            "model": shape.model, "service_tier": shape.service_tier, "choices": list(choices),
            "usage": usage(runs)}  # fmt: skip


async def events(shape: Shape, runs: Sequence[Run],
                 want_logprobs: bool) -> AsyncGenerator[str, None]:  # fmt: skip
    """Server-sent events: every run's pieces as they come, then usage and [DONE]."""
    created = int(time.time())
    kind = shape.kind + ".chunk" if shape.chat else shape.kind
    offsets = [len(e) for e in shape.echo] if shape.echo else [0] * len(runs)

    def chunk(index: int, piece: Piece | None, role: bool = False) -> str:
        choice: dict[str, Any] = {"index": index, "finish_reason": None, "logprobs": None}
        text = piece.text if piece else ""
        if piece is not None:
            choice["finish_reason"] = piece.finish
            if want_logprobs:
                choice["logprobs"] = shape.logprobs(piece.logprobs, offsets[index])
            offsets[index] += len(text)
        if shape.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})  # fmt: skip
        else:
            choice["text"] = text
        body = {"id": shape.rid, "object": kind, "created": created, "model": shape.model,
                "service_tier": shape.service_tier, "choices": [choice]}  # fmt: skip
        if shape.continuous_usage:
            body["usage"] = usage(runs)
        return f"data: {json.dumps(body)}\n\n"

    for index in range(len(runs)):
        if shape.chat:
            yield chunk(index, None, role=True)
        elif shape.echo:
            yield chunk(index, Piece(shape.echo[index]))
            offsets[index] = len(shape.echo[index])
    merged: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, run: Run) -> None:
        # Whatever ends a run, its end is posted: the merge below must never wait on a run
        # that is gone.
        try:
            async for piece in run.pieces():
                merged.put_nowait((index, piece))
        except Exception as exc:  # the engine stopped, or a fault: the client is told
            if not isinstance(exc, EngineStopped | RequestFailed):
                log.exception("stream %s failed", run.rid)
            merged.put_nowait((index, exc))
        finally:
            merged.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        open_runs = len(runs)
        while open_runs:
            index, item = await merged.get()
            if item is None:
                open_runs -= 1
            elif isinstance(item, RequestFailed):
                yield f"data: {json.dumps(item.body())}\n\n"
            elif isinstance(item, BaseException):
                error = {"error": {"message": str(item), "type": "server_error"}}
                yield f"data: {json.dumps(error)}\n\n"
            elif item.text or item.finish or (want_logprobs and item.logprobs):
                yield chunk(index, item)
    finally:
        for task in tasks:
            task.cancel()
    if shape.include_usage:
        body = {"id": shape.rid, "object": kind, "created": created, "model": shape.model,
                "service_tier": shape.service_tier, "choices": [],
                "usage": usage(runs)}  # fmt: skip
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


class RunStream(StreamingResponse):
    """A server-sent-event stream that aborts its requests however the response ends.

    The generator's own finally is not enough: Starlette may never resume it. Under ASGI HTTP
    spec 2.4 a send to a client that left raises, and Starlette (1.10) abandons the generator
    where it stands (before its first step, or at the chat role chunk, outside `Run.pieces`),
    so the request would wait for admission, run to its end and only then free its pages. A
    `BackgroundTask` does not cover it either: Starlette skips it when the stream raises.
    """

    def __init__(self, runs: Sequence[Run], body: AsyncGenerator[str, None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.runs, self.source = runs, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for run in self.runs:
                run.close()
            await self.source.aclose()
