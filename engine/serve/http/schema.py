"""Request bodies of the OpenAI API, validated by hand so every error names its field.

Fields this server does not know are ignored, and so is anything a client says about pages or
reservations: page counts come only from the model and the server's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.runner import SamplingParams

MAX_STOP_STRINGS = 16


class BadRequest(Exception):
    """Maps to HTTP 400 in OpenAI's error format, with the offending field as `param`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class Generation:
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(
            f"'{key}' must be a number, got {type(value).__name__}", key, "invalid_type"
        )
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo:g} and {hi:g}, got {value}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(
            f"'{key}' must be an integer, got {type(value).__name__}", key, "invalid_type"
        )
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{key}' must be {bound}, got {value}", key)
    return value


def _boolean(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false, got {value!r}", key, "invalid_type")
    return value


def parse_generation(body: dict[str, Any], vocab_size: int, max_tokens_key: str) -> Generation:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model", "invalid_type")
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
    max_tokens = _integer(body, max_tokens_key, 1)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = _integer(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("'top_p' must be above 0 (1 keeps every token), got 0", "top_p")
    top_k = _integer(body, "top_k", -1) or 0
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    sampling = SamplingParams(temperature, top_p, max(0, top_k), seed)
    stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _boolean(options, "include_usage")
    return Generation(
        max_tokens,
        sampling,
        _stop(body),
        _stop_token_ids(body, vocab_size),
        stream,
        include_usage,
        model,
    )


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(
            f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    return [s for s in stop if s]


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise BadRequest(
            "'stop_token_ids' must be a list of integers", "stop_token_ids", "invalid_type"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(
            f"'stop_token_ids' holds {bad[:4]}, outside the vocabulary 0..{vocab_size - 1}",
            "stop_token_ids",
        )
    return ids


def parse_prompt(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty; send at least one character", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(
                f"'prompt' holds token ids {bad[:4]} outside the vocabulary 0..{vocab_size - 1}",
                "prompt",
            )
        return list(prompt)
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    raise BadRequest(
        "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
        "prompt",
        "invalid_type",
    )


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages", "invalid_type")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"'{where}.role' must be a string", f"{where}.role", "invalid_type")
        parsed.append({"role": role, "content": _content(message.get("content"), where)})
    return parsed


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    f"'{where}.content[{j}]' must be a text part; this model reads text only",
                    f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(
                    f"'{where}.content[{j}].text' must be a string",
                    f"{where}.content",
                    "invalid_type",
                )
            texts.append(text)
        return "".join(texts)
    raise BadRequest(
        f"'{where}.content' must be a string or a list of text parts",
        f"{where}.content",
        "invalid_type",
    )
