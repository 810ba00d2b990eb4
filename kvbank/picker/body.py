"""A request body as the picker reads it: bounded, parsed, tokenized with the model's own
tokenizer and counted with `kvbank.capacity`, the count the pod's ledger will make.

The picker reads only what routing needs (model, prompt or messages, max_tokens, n,
service_tier) and leaves every other field to the engine, which refuses what it does not
serve; a field the picker reads and cannot take is refused here, with the engine's words
(engine/serve/http/schema.py), so a client gets the same 400 wherever it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvbank.capacity import CapacityModel, RequestShape
from kvbank.engine.model.tokenizer import ChatTemplateError, Tokenizer
from kvbank.engine.serve.http.errors import BadRequest, shown
from kvbank.engine.serve.http.schema import MAX_N, parse_messages, parse_prompts
from kvbank.engine.serve.http.tiers import requested_class
from kvbank.picker.prefix import MAX_PREFIX_BLOCKS, prompt_blocks
from kvbank.picker.rule import RequestCount, count_request
from kvbank.service_class import ServiceClass

DEFAULT_MAX_BODY_BYTES = 2 << 20  # the engine's own --max-body-bytes default

CHAT_PATHS = ("/v1/chat/completions",)
COMPLETION_PATHS = ("/v1/completions",)


@dataclass(frozen=True)
class Counter:
    """What counting needs: the pool's capacity model and size, its default class, and the
    model's tokenizer and name."""

    model: CapacityModel
    pool_pages: int
    tokenizer: Tokenizer
    served_name: str | None = None  # None: any model name is this pool's
    default_class: ServiceClass = ServiceClass.STRICT
    max_tokens: int | None = None  # the pool's limits.maxTokens, which its engines refuse above


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in `raw`; BadRequest (400) for anything else."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise BadRequest(
            "the request body nests JSON too deeply to parse; flatten it", None, "invalid_json"
        ) from exc
    except ValueError as exc:  # bad JSON, bad UTF-8, an over-long integer, NaN
        raise BadRequest(
            f"the request body is not valid JSON: {shown(str(exc), 200)}", None, "invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_json")
    return body


def _positive(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer, got {shown(value)}", key)
    return value


def count_body(counter: Counter, path: str, body: dict[str, Any]) -> RequestCount:
    """The request counted as the pod will count it. Several prompts of one completion request
    are each an engine request on the same pod: their pages add up, and one the pool can never
    hold refuses the whole request, as the engine does."""
    chat = path.split("?", 1)[0] in CHAT_PATHS
    model = body.get("model")
    if counter.served_name is not None and model is not None and model != counter.served_name:
        raise BadRequest(
            f"model {shown(model)} is not served by this pool; it serves {counter.served_name!r}",
            "model",
            "model_not_found",
            status=404,
        )
    n = _positive(body, "n") or 1
    if n > MAX_N:
        raise BadRequest(f"'n' is {n}; at most {MAX_N} sequences are sampled per prompt", "n")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    max_tokens = _positive(body, key)
    limit = counter.max_tokens
    if max_tokens is not None and limit is not None and max_tokens > limit:
        # The engine refuses it (400) before it submits: a pick would hold room for nothing.
        raise BadRequest(
            f"'{key}' is {max_tokens}; this pool allows at most {limit} (its limits.maxTokens)",
            key,
        )
    service_class = requested_class(body) or counter.default_class
    tokenizer = counter.tokenizer
    if chat:
        try:
            prompts = [tokenizer.encode_chat(parse_messages(body))]
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from exc
    else:
        prompts = [
            tokenizer.encode(p) if isinstance(p, str) else p
            for p in parse_prompts(body, tokenizer.vocab_size)
        ]
    page = counter.model.page_size
    counts = [
        count_request(
            counter.model,
            RequestShape(len(ids), max_tokens, sequences=n),
            counter.pool_pages,
            service_class,
            # Affinity is for a request of one prompt (several are counted summed, below).
            prefix_blocks=prompt_blocks(ids, page, MAX_PREFIX_BLOCKS) if len(prompts) == 1 else (),
        )
        for ids in prompts
    ]
    refused = next((c for c in counts if c.refusal is not None), None)
    if refused is not None:
        return refused
    if len(counts) == 1:
        return counts[0]  # with its shape, for a peak-fit pod's room curve
    return RequestCount(pages=sum(c.pages for c in counts), service_class=service_class)


def is_generation(path: str) -> bool:
    """Whether the path is one the picker counts (others go to any ready pod)."""
    return path.split("?", 1)[0] in CHAT_PATHS + COMPLETION_PATHS
