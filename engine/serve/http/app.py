"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (with server-sent events),
/v1/models, /health and /metrics, over an `EngineLoop`.

What a client sends is bounded before it costs anything: the body's size (413, from its
Content-Length before a byte of it is read), JSON a parser can hold (no 5,000-deep nesting, no
4,300-digit integers), text UTF-8 can carry. Tokenizing runs on a small thread pool with the GIL
released, so a long prompt never stalls /health or the other requests' streams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp

from kvbank.engine.engine import RequestRejected
from kvbank.engine.model.textstream import TextStream
from kvbank.engine.model.tokenizer import ChatTemplateError, Tokenizer
from kvbank.engine.runner import SamplingParams
from kvbank.engine.serve.http.auth import RequireApiKey
from kvbank.engine.serve.http.errors import BadRequest, error, shown
from kvbank.engine.serve.http.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_fields,
    response_grammar,
)
from kvbank.engine.serve.http.loop import (
    AdmissionUnavailable,
    EngineLoop,
    EngineStopped,
    QueueFull,
    Submission,
)
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.engine.serve.http.schema import (
    MAX_PROMPTS,
    Generation,
    parse_generation,
    parse_messages,
    parse_prompts,
)
from kvbank.engine.serve.http.stream import (
    RequestFailed,
    Run,
    RunStream,
    Shape,
    events,
    whole,
)
from kvbank.engine.serve.http.tiers import echoed_tier
from kvbank.service_class import ServiceClass

if TYPE_CHECKING:
    from kvbank.engine.model.grammar import GrammarCompiler

RETRY_AFTER_S = 1
HOLD_HEADER = "x-kvbank-hold"  # set by kvbank picker (kvbank/picker/extproc.py)
PICKED_RID = re.compile(r"(chatcmpl|cmpl)-[0-9a-f]{32}")
TOKENIZER_THREADS = 2  # long prompts tokenize two at a time; the rest wait their turn


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
    root: str = ""  # the model folder: where a client loads the tokenizer from
    max_body_bytes: int = 2 << 20
    api_keys: frozenset[str] = frozenset()
    grammars: GrammarCompiler | None = None  # None: structured output is refused


def create_app(served: Served, loop: EngineLoop, metrics: ServeMetrics) -> ASGIApp:
    app = FastAPI(title="kvbank", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = served.tokenizer
    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    retry_later = {"Retry-After": str(RETRY_AFTER_S)}

    @functools.lru_cache(maxsize=65536)
    def token_text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        metrics.requests.labels("invalid").inc()
        # A refused body may be unread: closing tells the client not to send the rest.
        headers = {"Connection": "close"} if exc.status != 400 else None
        return error(exc.status, exc.message, "invalid_request_error", exc.param, exc.code,
                     headers)  # fmt: skip

    @app.exception_handler(HTTPException)
    async def not_found(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {shown(request.url.path, 128)}"
            return error(405, message, "invalid_request_error", None, "method_not_allowed")
        message = (
            f"no route {request.method} {shown(request.url.path, 128)}; this server serves "
            "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics"
        )
        return error(exc.status_code, message, "invalid_request_error", None, "not_found")

    @app.exception_handler(EngineStopped)
    async def engine_stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        # A request that waited when admission was lost ends here too, its message the outage.
        code = "admission_unavailable" if loop.alive and loop.outage is not None else None
        return error(503, str(exc), "server_error", None, code, retry_later)

    @app.exception_handler(RequestFailed)
    async def request_failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health/live")
    async def live() -> Response:
        # The liveness probe: only a stopped engine loop needs a restart; a lost sidecar does
        # not (its running requests keep their pages and finish).
        if not loop.alive:
            return error(503, f"the engine loop stopped: {loop.error}", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        # The readiness probe: a pod that cannot admit is drained until its sidecar is back.
        if not loop.alive:
            return error(503, f"the engine loop stopped: {loop.error}", "server_error")
        outage = loop.outage
        if outage is not None:
            message = str(AdmissionUnavailable(outage))
            return error(503, message, "server_error", None, "admission_unavailable", retry_later)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def card() -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "kvbank",
            "root": served.root,
            "parent": None,
            "max_model_len": served.max_seq_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != served.name:
            return error(404, f"model {shown(model)} is not served here; this server serves "
                         f"{served.name!r}", "invalid_request_error", "model",
                         "model_not_found")  # fmt: skip
        return JSONResponse(card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request, served.max_body_bytes)
        check_fields(body, COMPLETION_FIELDS, "completions")
        gen = parse_generation(body, served.vocab_size, chat=False)
        _check_model(gen)
        prompts = parse_prompts(body, served.vocab_size)
        ids = [(await off_loop(tokenizer.encode, p)) if isinstance(p, str) else p for p in prompts]
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        echo = [text for text in echo for _ in range(gen.n)]  # per choice
        return await _generate(request, ids, gen, chat=False, echo=echo if gen.echo else [])

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request, served.max_body_bytes)
        check_fields(body, CHAT_FIELDS, "chat/completions")
        gen = parse_generation(body, served.vocab_size, chat=True)
        _check_model(gen)
        messages = parse_messages(body)
        grammar = await off_loop(response_grammar, body, served.grammars)
        if grammar is not None:
            gen = replace(gen, sampling=replace(gen.sampling, grammar=grammar))
        try:
            ids = await off_loop(tokenizer.encode_chat, messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from exc
        return await _generate(request, [ids], gen, chat=True, echo=[])

    def _check_model(gen: Generation) -> None:
        if gen.max_tokens is not None and gen.max_tokens > served.max_tokens:
            raise BadRequest(
                f"'{gen.max_tokens_param}' is {gen.max_tokens}; this server allows at most "
                f"{served.max_tokens} (its --max-tokens)",
                gen.max_tokens_param,
            )
        if gen.model is not None and gen.model != served.name:
            raise BadRequest(
                f"model {shown(gen.model)} is not served here; this server serves {served.name!r}",
                "model",
                "model_not_found",
            )

    async def _generate(request: Request, prompts: list[list[int]], gen: Generation, chat: bool,
                        echo: list[str]) -> Response:  # fmt: skip
        rid = picked_rid(request.headers.get(HOLD_HEADER), chat) or (
            ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        )
        submitted = time.monotonic()
        runs: list[Run] = []
        stop_ids = [*gen.stop_token_ids, *(() if gen.ignore_eos else served.extra_stop_ids)]
        if gen.sampling.grammar is not None and served.grammars is not None:
            stop_ids.append(served.grammars.eos_token_id)  # the grammar ends with it
        n = gen.n
        if len(prompts) * n > MAX_PROMPTS:
            raise BadRequest(
                f"'n' is {n} with {len(prompts)} prompts, {len(prompts) * n} choices; at most "
                f"{MAX_PROMPTS} go in one request: lower n or send fewer prompts",
                "n",
            )
        single = len(prompts) * n == 1
        granted: list[ServiceClass] = []
        for index, ids in enumerate(prompts):
            # Choice i * n + j is prompt i's sequence j, as OpenAI orders them; the n sequences
            # of a prompt are one engine request (they share the prompt's pages).
            subs = [
                Submission(rid if single else f"{rid}-{index * n + j}", ids, gen.max_tokens,
                           sequence_sampling(gen.sampling, j), asyncio.Queue(),
                           asyncio.get_running_loop())
                for j in range(n)
            ]  # fmt: skip
            head = replace(subs[0], siblings=tuple(subs[1:]), service_class=gen.service_class)
            refused = await _submit(head, gen.max_tokens_param, "messages" if chat else "prompt")
            if refused is not None:
                for run in runs:  # a batch is queued whole or not at all
                    run.close()
                return refused
            assert head.granted is not None  # set by the engine thread before it answered
            granted.append(head.granted)
            metrics.class_requests.labels(head.granted.value).inc()
            for j, sub in enumerate(subs):  # the prompt counts once in usage
                text = TextStream(tokenizer, gen.stop, stop_ids)
                runs.append(Run(sub.rid, sub.outputs, text, loop, metrics, submitted, request,
                                0 if j else len(ids)))  # fmt: skip
            metrics.prompt_tokens.inc(len(ids))
        tier = echoed_tier(gen.service_class, granted, loop.engine.config.classes.default_class)
        shape = Shape(rid, served.name, chat, token_text, echo, gen.include_usage,
                      gen.continuous_usage, tier)  # fmt: skip
        want_logprobs = gen.logprobs is not None
        if gen.stream:
            return RunStream(runs, events(shape, runs, want_logprobs))
        try:
            body = await whole(shape, runs, want_logprobs)
        finally:
            for run in runs:
                run.close()
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body)

    async def _submit(sub: Submission, max_tokens_param: str, prompt_param: str) -> Response | None:
        try:
            await loop.submit(sub)
        except asyncio.CancelledError:  # the command may be queued already: take it back
            for seq in (sub, *sub.siblings):
                loop.abort(seq.rid)
            raise
        except RequestRejected as exc:
            metrics.requests.labels("rejected").inc()
            # The parameter the refusal names, as the client named it: a chat's prompt is its
            # messages.
            named = {"max_tokens": max_tokens_param, "prompt": prompt_param}
            param = named.get(exc.param or "", exc.param)
            return error(400, str(exc), "invalid_request_error", param, "request_too_large")
        except QueueFull as exc:
            metrics.requests.labels("queue_full").inc()
            return error(429, str(exc), "rate_limit_error", None, "queue_full",
                         {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        except AdmissionUnavailable as exc:
            metrics.requests.labels("unavailable").inc()
            return error(503, str(exc), "server_error", None, "admission_unavailable",
                         retry_later)  # fmt: skip
        except (EngineStopped, TimeoutError) as exc:
            return error(503, f"the engine is not running: {exc}", "server_error", None, None,
                         retry_later)  # fmt: skip
        return None

    return RequireApiKey(app, served.api_keys) if served.api_keys else app


def picked_rid(hold: str | None, chat: bool) -> str | None:
    """The request id `kvbank picker` chose for this request (its `x-kvbank-hold` header):
    the engine's sidecar, seeing it submitted, releases the picker's hold on this pod's room
    (sidecar/routing.py). Only the picker's own form is taken; anything else is ignored."""
    if hold is None:
        return None
    prefix = "chatcmpl-" if chat else "cmpl-"
    return hold if PICKED_RID.fullmatch(hold) and hold.startswith(prefix) else None


def sequence_sampling(sampling: SamplingParams, sequence: int) -> SamplingParams:
    """Sequence `sequence` of a prompt samples with the request's seed plus its number, so a
    seeded request with n > 1 gives n different, reproducible choices."""
    if not sequence or sampling.seed is None:
        return sampling
    seed = (sampling.seed + sequence + (1 << 63)) % (1 << 64) - (1 << 63)  # within int64
    return replace(sampling, seed=seed)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object in the body, read only up to `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = (
        f"the request body is over this server's limit of {limit} bytes (its --max-body-bytes); "
        "send a shorter prompt"
    )
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(too_large, None, "request_too_large", status=413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(too_large, None, "request_too_large", status=413)
            chunks.append(chunk)
    except ClientDisconnect as exc:  # gone, or cut off by the body deadline: nobody reads this
        raise BadRequest("the client left before its body arrived", None, "request_timeout",
                         status=408) from exc  # fmt: skip
    try:
        body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except RecursionError as exc:
        raise BadRequest(
            "the request body nests JSON too deeply to parse; flatten it", None, "invalid_json"
        ) from exc
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer over 4,300 digits, NaN
        raise BadRequest(
            f"the request body is not valid JSON: {shown(str(exc), 200)}", None, "invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_json")
    return body
