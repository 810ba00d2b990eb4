"""Sampling parameters a client may send that once stopped the engine thread, and structured
output that claimed a finish it never reached, against a live server. Each request gets its
answer (a 200, or a 4xx naming the field) and the engine keeps serving the next one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http.conftest import LiveServer

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
QUOTE_TOKEN = 6  # '"' in the built-in tokenizer: a JSON string's first token


def still_serving(live: LiveServer) -> None:
    assert live.loop.alive, f"the engine loop stopped: {live.loop.error!r}"
    assert live.client.get("/health").status_code == 200
    again = live.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert again.status_code == 200, again.text


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 1e-39}, {"top_p": 1e-46}, {"temperature": 1e-39, "top_p": 1e-46, "seed": 1},
     {"temperature": 5e-324, "top_k": 1}],
    ids=["temperature", "top_p", "both", "denormal"],
)  # fmt: skip
def test_a_tiny_temperature_or_top_p_is_greedy_and_the_engine_runs_on(
    live: LiveServer, fields: dict[str, Any]
) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, **fields}
    response = live.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    greedy = live.client.post("/v1/completions", json={**body, "temperature": 0, "top_p": 1})
    assert response.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    still_serving(live)


# What validation accepts, edges included: the values a probe finds first.
TEMPERATURE = st.one_of(st.sampled_from([0.0, 1e-39, 5e-324, 1e-5, 2.0]),
                        st.floats(0.0, 2.0, allow_subnormal=True))  # fmt: skip
TOP_P = st.one_of(st.sampled_from([1e-46, 5e-324, 1e-5, 1.0]),
                  st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True))  # fmt: skip
PENALTY = st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2.0, 2.0))
BIAS = st.dictionaries(st.integers(0, 1023).map(str), st.sampled_from([-100, 100, 0, 1e-300]),
                       max_size=4)  # fmt: skip
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "top_k": st.integers(-1, 2000),
        "seed": st.integers(-(1 << 63), (1 << 63) - 1),
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "logit_bias": BIAS,
        "n": st.integers(1, 3),
        "logprobs": st.integers(0, 5),
        "stream": st.booleans(),
    },
)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(params=PARAMS)
def test_accepted_sampling_parameters_never_stop_the_engine(
    live: LiveServer, params: dict[str, Any]
) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, **params}
    response = live.client.post("/v1/completions", json=body)
    assert response.status_code == 200, (params, response.text)
    if not params.get("stream"):
        assert all(c["finish_reason"] == "length" for c in response.json()["choices"])
    assert live.loop.alive, f"{params} stopped the engine loop: {live.loop.error!r}"


def chat(live: LiveServer, schema: dict[str, Any], **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                       "schema": schema}},
            **fields}  # fmt: skip
    return live.client.post(CHAT, json=body)


@pytest.mark.parametrize(
    "schema",
    [{"type": "string", "pattern": "^a{1000000}$"}, {"$ref": "#"},
     {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}],
    ids=["huge-repeat", "self", "self-def", "self-required"],
)  # fmt: skip
def test_a_schema_the_matcher_gives_up_on_is_refused_when_compiled(
    live: LiveServer, schema: dict[str, Any]
) -> None:
    response = chat(live, schema)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert "gives up before the response's first free token" in error["message"]
    still_serving(live)


# The grammar can start with a number or a string; only the string breaks the matcher, once its
# first token is in. logit_bias makes greedy pick that token.
GIVES_UP_PARTWAY = {"anyOf": [{"type": "string", "pattern": "^a{1000000}$"}, {"type": "integer"}]}


def test_a_grammar_that_gives_up_partway_ends_its_request_with_an_error(live: LiveServer) -> None:
    response = chat(live, GIVES_UP_PARTWAY, temperature=0, logit_bias={str(QUOTE_TOKEN): 100})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert error["code"] == "generation_failed"
    assert "gave up on the response_format schema partway" in error["message"]
    still_serving(live)


def test_a_streamed_grammar_that_gives_up_partway_sends_an_error_not_a_stop(
    live: LiveServer,
) -> None:
    response = chat(live, GIVES_UP_PARTWAY, temperature=0, stream=True,
                    logit_bias={str(QUOTE_TOKEN): 100})  # fmt: skip
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert [e["error"]["param"] for e in events if "error" in e] == ["response_format"]
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])]
    assert reasons == [None] * len(reasons)  # no "stop" it did not reach
    still_serving(live)
