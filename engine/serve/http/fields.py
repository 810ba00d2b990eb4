"""Which request fields each route honours, and why the others are refused.

No field is ignored: a request naming a field outside its route's list gets 400 naming that field,
with the reason when the field is one of OpenAI's. Fields that are honoured only for some values
(`n`, `response_format`, `tool_choice` ...) are checked here too, so the parser in `schema` only
reads values it can honour. docs/api.md holds the same table for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbank.engine.serve.http.errors import BadRequest, field_name, shown

if TYPE_CHECKING:
    from kvbank.engine.model.grammar import GrammarCompiler

SHARED = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "stream", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "n",
    "user", "ignore_eos", "service_tier",
})  # fmt: skip
COMPLETION_FIELDS = SHARED | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = SHARED | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "store",
}  # fmt: skip

NO_GRAMMAR = (
    "this server constrains decoding to JSON schemas only, so it cannot promise {what}; "
    "drop '{field}' (a response_format json_schema can describe the call you want)"
)
# OpenAI fields a route does not serve, with the reason and what to do instead.
REFUSED = {
    "functions": "the legacy 'functions' field is not supported, and neither are 'tools'",
    "function_call": "the legacy 'function_call' field is not supported",
    "audio": "this model produces text only",
    "modalities": "this model produces text only; drop 'modalities'",
    "prediction": "predicted outputs are not supported; drop 'prediction'",
    "reasoning_effort": "this model has no reasoning mode; drop 'reasoning_effort'",
    "web_search_options": "this server does not search the web",
    "metadata": "this server stores no completions, so 'metadata' would be lost; drop it",
    "min_tokens": "'min_tokens' is not supported; use 'ignore_eos' to run to max_tokens",
    "repetition_penalty": "use 'presence_penalty' or 'frequency_penalty' instead",
    "min_p": "'min_p' is not supported; use 'top_p' or 'top_k'",
}


def check_fields(body: dict[str, Any], allowed: frozenset[str], route: str) -> None:
    """Refuse any field `route` does not honour, and the values of honoured fields it cannot."""
    for key in body:
        if key in allowed:
            continue
        name = field_name(key)
        reason = REFUSED.get(key)
        if reason is None:
            other = "chat" if route == "completions" else "completions"
            known = CHAT_FIELDS if route == "completions" else COMPLETION_FIELDS
            reason = (
                f"it belongs to /v1/{other}, not /v1/{route}"
                if key in known
                else f"/v1/{route} has no such field"
            )
        raise BadRequest(f"unsupported field '{name}': {reason}", name, "unsupported_parameter")
    _check_partial(body)


def _check_partial(body: dict[str, Any]) -> None:
    best_of = body.get("best_of")
    if best_of is not None and (
        isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != (body.get("n") or 1)
    ):  # true == 1 in Python, and would pass for n = 1 as a number it is not
        raise BadRequest(
            f"'best_of' is {shown(best_of)}; this server returns every sequence it samples, so "
            "best_of must be an integer equal to n (or be omitted)",
            "best_of",
        )
    if body.get("suffix") not in (None, ""):
        raise BadRequest(
            "'suffix' (insertion) is not supported: this model only continues a prompt; "
            "drop 'suffix'",
            "suffix",
        )
    response_format = body.get("response_format")
    if response_format is not None:
        _check_response_format(response_format)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest(
            f"'tools' must be a list of tools, got {shown(tools)}; this server calls none, so "
            "send [] or drop it",
            "tools",
            "invalid_type",
        )
    if tools:
        raise BadRequest(NO_GRAMMAR.format(what="well-formed tool calls", field="tools"), "tools")
    if body.get("tool_choice") not in (None, "none"):
        raise BadRequest(
            "'tool_choice' can only be 'none': this server does not call tools", "tool_choice"
        )
    if body.get("store") not in (None, False):
        raise BadRequest("this server stores no completions; send 'store': false or omit it",
                         "store")  # fmt: skip
    if body.get("echo") and body.get("logprobs") is not None:
        raise BadRequest(
            "'echo' with 'logprobs' would need the prompt's log-probabilities, which this server "
            "does not compute; drop one of them",
            "echo",
        )


# What each response_format type carries besides its type: anything else would be ignored.
FORMAT_FIELDS = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}}
SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


def _check_response_format(response_format: Any) -> None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if not isinstance(kind, str) or kind not in FORMAT_FIELDS:
        raise BadRequest(
            f"'response_format.type' must be text, json_object or json_schema, got {shown(kind)}",
            "response_format",
        )
    assert isinstance(response_format, dict)
    for key in response_format:
        if key != "type" and key not in FORMAT_FIELDS[kind]:
            takes = "only 'type'" if not FORMAT_FIELDS[kind] else "'type' and 'json_schema'"
            raise BadRequest(
                f"'response_format' of type {kind} has field {shown(key)}, which it does not "
                f"use: a {kind} format takes {takes} (a schema needs type json_schema)",
                "response_format",
                "unsupported_parameter",
            )
    spec = response_format.get("json_schema")
    if isinstance(spec, dict):
        for key in spec:
            if key not in SCHEMA_FIELDS:
                raise BadRequest(
                    f"'response_format.json_schema' has field {shown(key)}, which this server "
                    f"does not read; it takes {', '.join(sorted(SCHEMA_FIELDS))}",
                    "response_format",
                    "unsupported_parameter",
                )


def response_grammar(body: dict[str, Any], compiler: GrammarCompiler | None) -> str | None:
    """The grammar a chat request's response_format asks for (None: free text). Raises
    BadRequest naming response_format when the schema cannot be compiled."""
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if compiler is None:
        raise BadRequest(
            "this server was started without a grammar engine (llguidance is not installed), "
            "so it cannot promise a structured response; drop 'response_format'",
            "response_format",
        )
    schema = None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest(
                "'response_format.json_schema' must be an object whose 'schema' is a JSON schema",
                "response_format",
                "invalid_type",
            )
        schema = spec.get("schema")
    from kvbank.engine.model.grammar import GrammarError

    try:
        return compiler.json_schema(schema)
    except GrammarError as exc:
        raise BadRequest(
            f"'response_format' holds a schema the grammar engine cannot compile: {str(exc)[:300]}",
            "response_format",
        ) from exc
