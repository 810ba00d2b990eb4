"""Request bodies of the OpenAI API, validated by hand so every error names its field.

Which fields a route takes is `fields`' business (no field is ignored); this module reads their
values. Page counts come only from the model and the server's tokenizer, never from a client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbank.engine.runner import SamplingParams
from kvbank.engine.serve.http.errors import BadRequest, field_name, shown
from kvbank.engine.serve.http.tiers import requested_class
from kvbank.service_class import ServiceClass

__all__ = ["BadRequest", "Generation", "parse_generation", "parse_messages", "parse_prompts"]

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one completion request, each its own engine request
MAX_N = 16  # sequences sampled per prompt; prompts x n is at most MAX_PROMPTS choices
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20


@dataclass
class Generation:
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    max_tokens_param: str = "max_tokens"  # the field the client set it with, for errors
    echo: bool = False
    service_class: ServiceClass | None = None  # from service_tier; None: the pool's default
    ignore_eos: bool = False
    continuous_usage: bool = False  # vLLM's extension: usage so far in every streamed chunk
    n: int = 1  # sequences per prompt, admitted together and sharing the prompt's pages

    @property
    def logprobs(self) -> int | None:
        return self.sampling.logprobs


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


def text(value: Any, where: str) -> str:
    """`value` as a string UTF-8 can carry: JSON may hold a lone surrogate ("\\ud800"), which no
    tokenizer can encode."""
    if not isinstance(value, str):
        raise BadRequest(f"'{where}' must be a string", where, "invalid_type")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"'{where}' holds a lone UTF-16 surrogate ({value[exc.start]!a}) at character "
            f"{exc.start}, which is not text; send valid Unicode",
            where,
        ) from exc
    return value


def parse_generation(body: dict[str, Any], vocab_size: int, chat: bool) -> Generation:
    model = body.get("model")
    if model is not None:
        text(model, "model")
    n = _integer(body, "n", 1) or 1
    if n > MAX_N:
        raise BadRequest(
            f"'n' is {n}; this server samples at most {MAX_N} sequences from one prompt: send "
            f"n <= {MAX_N}, or repeat the request",
            "n",
        )
    max_tokens_param = "max_tokens"
    max_tokens = None
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_param = "max_completion_tokens"
        max_tokens = _integer(body, max_tokens_param, 1)
    else:
        max_tokens = _integer(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("'top_p' must be above 0 (1 keeps every token), got 0", "top_p")
    top_k = _integer(body, "top_k", -1) or 0
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    ignore_eos = _boolean(body, "ignore_eos")
    sampling = SamplingParams(
        temperature,
        top_p,
        max(0, top_k),
        seed,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab_size),
        logprobs=_chat_logprobs(body) if chat else _integer(body, "logprobs", 0, MAX_LOGPROBS),
        ignore_eos=ignore_eos,
    )
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadRequest(
            f"'stream_options' must be an object, got {shown(options)}",
            "stream_options",
            "invalid_type",
        )
    if options and not stream:
        raise BadRequest(
            "'stream_options' applies only to a streamed response; send 'stream': true or drop "
            "'stream_options'",
            "stream_options",
        )
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise BadRequest(
                f"'stream_options' has no field {shown(key)}; it takes 'include_usage' and "
                "'continuous_usage_stats'",
                "stream_options",
                "unsupported_parameter",
            )
    include_usage = _boolean(options, "include_usage")
    continuous_usage = _boolean(options, "continuous_usage_stats")
    user = body.get("user")
    if user is not None:
        text(user, "user")
    return Generation(
        max_tokens,
        sampling,
        _stop(body),
        _stop_token_ids(body, vocab_size),
        stream,
        include_usage,
        model,
        max_tokens_param,
        echo=False if chat else _boolean(body, "echo"),
        service_class=requested_class(body),
        ignore_eos=ignore_eos,
        continuous_usage=continuous_usage,
        n=n,
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest(
            "'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type"
        )
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"'logit_bias' holds {len(bias)} tokens; at most {MAX_LOGIT_BIAS} are allowed",
            "logit_bias",
        )
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_key(key, vocab_size)
        if token is None:
            raise BadRequest(
                f"'logit_bias' key {shown(key)} is not a token id in the vocabulary "
                f"0..{vocab_size - 1}",
                "logit_bias",
            )
        if token in pairs:  # "5", "05" and "005" would add up on one token
            raise BadRequest(
                f"'logit_bias' names token {token} twice (key {shown(key)}); give each token "
                f"one key",
                "logit_bias",
            )
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not -100 <= value <= 100:
            raise BadRequest(
                f"'logit_bias' of token {token} must be a number between -100 and 100, "
                f"got {shown(value)}",
                "logit_bias",
            )
        pairs[token] = float(value)
    return tuple(pairs.items())


def _token_key(key: str, vocab_size: int) -> int | None:
    """A logit_bias key as a token id, None when it is not one. Leading zeros are dropped
    before int() sees it: a key of 5,000 digits is past Python's int-from-str limit, and no
    id in a vocabulary has more digits than the vocabulary's size."""
    if not (key.isascii() and key.isdigit()):
        return None
    digits = key.lstrip("0") or "0"
    if len(digits) > len(str(vocab_size)):
        return None
    token = int(digits)
    return token if token < vocab_size else None


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop", "invalid_type")
    for s in stop:
        text(s, "stop")
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


def parse_prompts(body: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of token ids, or a list of either
    (each its own choice, in order)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_one_prompt(prompt, "prompt", vocab_size)]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(
                f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} go in one request",
                "prompt",
            )
        return [_one_prompt(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    raise BadRequest(
        "'prompt' must be a non-empty string, a list of token ids, or a list of those",
        "prompt",
        "invalid_type",
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _one_prompt(prompt: Any, where: str, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(f"'{where}' is empty; send at least one character", "prompt")
        text(prompt, where)
        return prompt
    if _is_ids(prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(
                f"'{where}' holds token ids {bad[:4]} outside the vocabulary 0..{vocab_size - 1}",
                "prompt",
            )
        return list(prompt)
    raise BadRequest(
        f"'{where}' must be a non-empty string or a list of token ids", "prompt", "invalid_type"
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
        text(role, f"{where}.role")
        for key in message:
            if key not in ("role", "content", "name"):
                raise BadRequest(
                    f"'{where}' has field {shown(key)}, which this server does not read "
                    "(tool calls are not supported); a message takes role, content and name",
                    f"{where}.{field_name(key)}",
                    "unsupported_parameter",
                )
        entry = {"role": role, "content": _content(message.get("content"), where)}
        if message.get("name") is not None:  # handed to the chat template, which may read it
            entry["name"] = text(message["name"], f"{where}.name")
        parsed.append(entry)
    return parsed


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return text(content, f"{where}.content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    f"'{where}.content[{j}]' must be a text part; this model reads text only",
                    f"{where}.content",
                )
            for key in part:
                if key not in ("type", "text"):
                    raise BadRequest(
                        f"'{where}.content[{j}]' has field {shown(key)}, which this server does "
                        "not read (prompt caching is automatic here: a repeated prefix is "
                        "cached without 'cache_control'); a text part takes type and text",
                        f"{where}.content[{j}].{field_name(key)}",
                        "unsupported_parameter",
                    )
            part_text = part.get("text")
            if not isinstance(part_text, str):
                raise BadRequest(
                    f"'{where}.content[{j}].text' must be a string",
                    f"{where}.content",
                    "invalid_type",
                )
            texts.append(text(part_text, f"{where}.content"))
        return "".join(texts)
    raise BadRequest(
        f"'{where}.content' must be a string or a list of text parts",
        f"{where}.content",
        "invalid_type",
    )
