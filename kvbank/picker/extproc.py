"""The Endpoint Picker protocol (GAIE's `004-endpoint-picker-protocol`): Envoy's `ext_proc`
stream, one per HTTP request.

Envoy sends the request headers, then the body in chunks. The picker gathers the body (it must
read the prompt before it can choose), counts the request, chooses with the rule and holds room
on the chosen pod, then answers:

- a pick: `x-gateway-destination-endpoint: ip:port` and `x-kvbank-hold` (the hold, which the
  engine hands back to its sidecar at submit) on the request, and the same endpoint in the
  `envoy.lb` dynamic metadata, never two different values;
- 400 with the capacity function's message when no pod could ever hold it, 429 when a
  best-effort request finds every pod full, 503 when no endpoint is ready (also when the subset
  hint, `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, leaves none);
- 4xx for a body that cannot be read (too large, not JSON, nested too deep, longer or shorter
  than its Content-Length): an immediate response, taken before any hold, so it costs none.

Body modes: FULL_DUPLEX_STREAMED (GAIE's: the header answer waits for the whole body, then the
body goes back as streamed responses) and BUFFERED (the headers are answered at once, the
destination rides on the body's answer). Envoy names its mode in `protocol_config`; with none,
full duplex is assumed. In the other modes the request's destination is fixed before its body is
read, so a request with a body gets 500 naming the setting to change. Response phases, if Envoy
is set to send them, pass through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvbank.engine.serve.http.errors import BadRequest
from kvbank.picker.body import CHAT_PATHS, Counter, count_body, is_generation, parse_json
from kvbank.picker.lobby import DEFAULT_MAX_HOLD_S, Lobby
from kvbank.picker.metrics import PickerMetrics
from kvbank.picker.rule import NoEndpoint, Pick, PodFigures, Refuse, RequestCount, Shed, pick
from kvbank.picker.sidecars import Sidecars
from kvbank.proto import admission_pb2 as pb
from kvbank.service_class import ServiceClass

log = logging.getLogger("kvbank.picker")

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
HOLD_HEADER = "x-kvbank-hold"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
PICK_ATTEMPTS = 4  # re-picks after holds lost to other picks before answering 503
TOKENIZE_OFF_LOOP_BYTES = 16_384  # longer bodies tokenize on a thread, off the event loop
TOO_MANY_TRIES = NoEndpoint(
    f"every pick's hold went to another request first ({PICK_ATTEMPTS} tries); retry"
)


@dataclass(frozen=True)
class Settings:
    counter: Counter
    max_body_bytes: int
    hold_ttl_s: float = 5.0
    max_hold_s: float = DEFAULT_MAX_HOLD_S  # the lobby's (0: a strict request queues at once)


@dataclass
class Stream:
    """One request's ext_proc stream as it arrives."""

    path: str = ""
    declared: int | None = None  # Content-Length, when sent
    mode: int = FULL_DUPLEX
    subset: list[str] | None = None  # None: no hint; pick from every pod
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0


class Refusal(Exception):
    """An answer other than a pick: an immediate response with this status."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 outcome: str = "bad_request") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.outcome = outcome  # the kvbank_picker_answers label


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


def _headers(request: ep.HttpHeaders) -> dict[str, str]:
    return {
        h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
        for h in request.headers.headers
    }


def _subset(request: ep.ProcessingRequest) -> list[str] | None:
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


def _streamed(body: bytes, end: bool) -> ep.BodyResponse:
    """A body phase's answer in full-duplex mode: the body itself, streamed back unchanged."""
    mutation = ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end)
    )
    return ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))


def immediate(refusal: Refusal) -> ep.ProcessingResponse:
    message = refusal.message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": refusal.kind, "param": None,
                      "code": refusal.code}}  # fmt: skip
    headers = ep.HeaderMutation(set_headers=[_header("content-type", "application/json")])
    if refusal.status == 429:
        headers.set_headers.append(_header("retry-after", str(Shed.retry_after_s)))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),  # type: ignore[arg-type]
            headers=headers,
            body=json.dumps(body).encode(),
            details=f"kvbank_picker_{refusal.status}",
        )
    )


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, settings: Settings, sidecars: Sidecars, metrics: PickerMetrics) -> None:
        self.settings = settings
        self.sidecars = sidecars
        self.metrics = metrics
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="picker-tokenize")
        self.lobby = Lobby(settings.max_hold_s)

    async def Process(  # gRPC method name
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = Stream()
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    async for answer in self._on_headers(stream, request):
                        yield answer
                elif kind == "request_body":
                    async for answer in self._on_body(stream, request.request_body):
                        yield answer
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_headers":
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    yield self._pass_response_body(stream, request.response_body)
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        except Refusal as refusal:
            self.metrics.answers.labels(refusal.outcome).inc()
            yield immediate(refusal)  # Envoy ends the stream after an immediate response

    async def _on_headers(
        self, stream: Stream, request: ep.ProcessingRequest
    ) -> AsyncIterator[ep.ProcessingResponse]:
        headers = _headers(request.request_headers)
        stream.path = headers.get(":path", "")
        stream.subset = _subset(request)
        if request.HasField("protocol_config"):
            stream.mode = request.protocol_config.request_body_mode
        if stream.mode not in (FULL_DUPLEX, BUFFERED) and not request.request_headers.end_of_stream:
            mode = processing_mode_pb2.ProcessingMode.BodySendMode.Name(stream.mode)
            raise Refusal(500, f"the gateway sends request bodies to the picker in mode {mode}, "
                          "in which the destination is fixed before the prompt is read; configure "
                          "its ext_proc request_body_mode FULL_DUPLEX_STREAMED (or BUFFERED)",
                          "server_error", "picker_misconfigured", "misconfigured")  # fmt: skip
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise Refusal(400, f"Content-Length {length[:40]!r} is not a number",
                              "invalid_request_error")  # fmt: skip
            stream.declared = int(length)
            if stream.declared > self.settings.max_body_bytes:
                raise Refusal(413, self._too_large(), "invalid_request_error", "request_too_large")
        if request.request_headers.end_of_stream:  # no body: any ready pod serves it
            response = await self._decide(stream, None)
            yield ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=response[0]),
                dynamic_metadata=response[1],
            )
            return
        if stream.mode != FULL_DUPLEX:
            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())

    def _too_large(self) -> str:
        return (
            f"the request body is over the picker's limit of {self.settings.max_body_bytes} "
            "bytes (its --max-body-bytes); send a shorter prompt"
        )

    async def _on_body(
        self, stream: Stream, body: ep.HttpBody
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream.size += len(body.body)
        if stream.size > self.settings.max_body_bytes:
            raise Refusal(413, self._too_large(), "invalid_request_error", "request_too_large")
        if stream.declared is not None and stream.size > stream.declared:
            raise Refusal(400, f"the body is longer than its Content-Length of "
                          f"{stream.declared} bytes", "invalid_request_error")  # fmt: skip
        stream.chunks.append(body.body)
        if not (body.end_of_stream or body.end_of_stream_without_message):
            return
        if stream.declared is not None and stream.size < stream.declared:
            short = f"the body ended at {stream.size} bytes, short of its Content-Length"
            raise Refusal(400, f"{short} of {stream.declared}", "invalid_request_error")
        raw = b"".join(stream.chunks)
        common, metadata = await self._decide(stream, raw)
        if stream.mode == FULL_DUPLEX:
            yield ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            )
            yield ep.ProcessingResponse(request_body=_streamed(raw, True))
        else:
            yield ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
            )

    def _pass_response_body(self, stream: Stream, body: ep.HttpBody) -> ep.ProcessingResponse:
        if stream.mode == FULL_DUPLEX:
            return ep.ProcessingResponse(response_body=_streamed(body.body, body.end_of_stream))
        return ep.ProcessingResponse(response_body=ep.BodyResponse())

    async def _decide(
        self, stream: Stream, raw: bytes | None
    ) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
        """Count, choose and hold; the header mutation and metadata of a pick, or Refusal."""
        started = time.perf_counter()
        count = await self._count(stream, raw)
        candidates = self.sidecars.candidates()
        if stream.subset is not None:
            allowed = set(stream.subset)
            candidates = [pod for pod in candidates if pod.name in allowed]
            if not candidates:
                none = f"none of the {len(allowed)} endpoints of the subset hint is a ready pod"
                raise Refusal(503, none, "server_error", "no_endpoint", "no_endpoint")
        chat = stream.path.split("?", 1)[0] in CHAT_PATHS
        chosen, hold_id, held_s = await self._choose(count, candidates, chat)
        self.metrics.decision.observe(time.perf_counter() - started - held_s)
        headers = [_header(DESTINATION, chosen)]
        if hold_id:
            headers.append(_header(HOLD_HEADER, hold_id))
        metadata = struct_pb2.Struct()  # {"envoy.lb": {DESTINATION: chosen}}, built by field
        metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = chosen
        common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=headers))
        return common, metadata

    async def _count(self, stream: Stream, raw: bytes | None) -> RequestCount | None:
        if raw is None or not is_generation(stream.path):
            return None
        try:
            body = parse_json(raw)
            if len(raw) > TOKENIZE_OFF_LOOP_BYTES:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    self._threads, count_body, self.settings.counter, stream.path, body
                )
            return count_body(self.settings.counter, stream.path, body)
        except BadRequest as exc:
            raise Refusal(exc.status, exc.message, "invalid_request_error", exc.code) from exc

    async def _choose(
        self, count: RequestCount | None, candidates: list[PodFigures], chat: bool
    ) -> tuple[str, str | None, float]:
        """The endpoint, the hold taken there (None for a request that is not counted) and how
        long the request was held in the lobby."""
        if count is None:  # not a generation: the ready pod with the most headroom
            ready = [pod for pod in candidates if pod.ready]
            if not ready:
                raise Refusal(503, "no ready endpoint in this pool", "server_error", "no_endpoint",
                              "no_endpoint")  # fmt: skip
            self.metrics.answers.labels("pick").inc()
            return max(ready, key=lambda p: (p.headroom_pages, p.name)).name, None, 0.0
        # The engine takes this as its request id, so its submit releases the hold.
        hold_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        allowed = {pod.name for pod in candidates}  # the subset hint's, less pods that failed

        def fresh() -> list[PodFigures]:
            return [pod for pod in self.sidecars.candidates() if pod.name in allowed]

        if count.service_class is ServiceClass.STRICT and self.lobby.max_hold_s > 0:
            return await self._held(count, hold_id, allowed, fresh)
        for attempt in range(PICK_ATTEMPTS):
            answer = pick(count, candidates)
            if not isinstance(answer, Pick):
                raise self._refusal(answer)
            last = attempt == PICK_ATTEMPTS - 1
            if await self._hold(count, answer, hold_id, candidates, allowed, last):
                return answer.pod, hold_id, 0.0
            candidates = fresh()
        raise self._refusal(TOO_MANY_TRIES)

    async def _held(
        self,
        count: RequestCount,
        hold_id: str,
        allowed: set[str],
        fresh: Callable[[], list[PodFigures]],
    ) -> tuple[str, str, float]:
        """A strict request in the lobby (kvbank/picker/lobby.py): asked again whenever a pod's
        figures change, it goes to the first pod that admits it; past --max-hold-s, where it
        starts soonest, to wait in that pod's queue."""
        loop = asyncio.get_running_loop()
        self.lobby.enter(hold_id, count, loop.time())
        self.metrics.held.inc()
        deadline = self.lobby.since(hold_id) + self.lobby.max_hold_s
        late_tries = 0  # holds tried past --max-hold-s: at most PICK_ATTEMPTS, as unheld
        try:
            while True:
                candidates = fresh()
                answer = self.lobby.ask(hold_id, candidates, loop.time())
                if answer is None:
                    await self.sidecars.changed(max(0.0, deadline - loop.time()))
                    continue
                if not isinstance(answer, Pick):
                    raise self._refusal(answer)
                if loop.time() >= deadline:
                    late_tries += 1
                last = late_tries >= PICK_ATTEMPTS
                if await self._hold(count, answer, hold_id, candidates, allowed, last):
                    held_s = loop.time() - self.lobby.since(hold_id)
                    self.metrics.held_seconds.observe(held_s)
                    return answer.pod, hold_id, held_s
                if last:
                    raise self._refusal(TOO_MANY_TRIES)
                if loop.time() < deadline:
                    # The room went to another pick: ask again once a pod's figures change,
                    # not at once (a sidecar whose figures and holds disagree is not spun on).
                    await self.sidecars.changed(max(0.0, deadline - loop.time()))
        finally:
            self.lobby.leave(hold_id)
            self.metrics.held.dec()

    async def _hold(
        self,
        count: RequestCount,
        answer: Pick,
        hold_id: str,
        seen: list[PodFigures],
        allowed: set[str],
        last: bool,
    ) -> bool:
        """Hold the pick's room on its pod. False: the room went to another pick first (the
        pod's figures are updated), or the pod did not answer (it leaves `allowed`)."""
        ahead = None
        if count.service_class is ServiceClass.BEST_EFFORT:
            kind, pages = pb.HoldRequest.BEST_EFFORT, count.pages_to_start
        else:
            kind = pb.HoldRequest.QUEUE if answer.waits else pb.HoldRequest.NOW
            pages = count.pages
            if answer.waits and not last:  # the last try queues anyway
                ahead = sum(next(p for p in seen if p.name == answer.pod).waiting_pages)
        granted = await self.sidecars.hold(
            answer.pod, hold_id, pages, kind, self.settings.hold_ttl_s, ahead, count
        )
        if granted:
            self.metrics.answers.labels("wait" if answer.waits else "pick").inc()
            return True
        if granted is False:
            self.metrics.hold_refusals.inc()
        else:  # no answer in time: not this pod, for this request
            allowed.discard(answer.pod)
        return False

    @staticmethod
    def _refusal(answer: Refuse | Shed | NoEndpoint) -> Refusal:
        kind_of = {400: "invalid_request_error", 429: "rate_limit_error"}
        code = {400: "request_too_large", 429: "shed", 503: "no_endpoint"}
        outcome = {400: "refused", 429: "shed"}.get(answer.status, "no_endpoint")
        return Refusal(answer.status, answer.message, kind_of.get(answer.status, "server_error"),
                       code.get(answer.status), outcome)  # fmt: skip
