"""Every feature the API honours, through the official `openai` client against a real server, and
every field it refuses, refused through it with the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvbank.engine.model.tokenizer import Tokenizer
from tests.http.conftest import LiveServer

MODEL = "kvbank-builtin"


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path) -> Tokenizer:
    return Tokenizer(builtin_model_dir)


def test_models_list_and_retrieve_give_the_tokenizer_root(
    client: openai.OpenAI, builtin_model_dir: Path
) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    assert Path(card.model_extra["root"]) == builtin_model_dir.resolve()  # type: ignore[index]
    assert (Path(card.model_extra["root"]) / "tokenizer.json").exists()  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_unknown_routes_get_openai_style_404s(live: LiveServer) -> None:
    response = live.client.post("/v1/embeddings", json={"input": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "not_found"
    assert "/v1/completions" in error["message"]
    wrong_method = live.client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_completion_logprobs_and_echo(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    done = client.completions.create(
        model=MODEL, prompt="The page cache", max_tokens=6, temperature=0, logprobs=3
    )
    choice = done.choices[0]
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert done.usage is not None and len(lp.tokens or []) == done.usage.completion_tokens == 6
    if "\ufffd" not in choice.text:  # a token inside a character reads as U+FFFD alone
        assert "".join(lp.tokens or []) == choice.text
    for token, value, top in zip(lp.tokens or [], lp.token_logprobs or [],
                                 lp.top_logprobs or [], strict=True):  # fmt: skip
        # Keyed by text, so two tokens that both read U+FFFD share a key.
        assert 1 <= len(top) <= 3 and value <= 0.0
        assert max(top.values()) == pytest.approx(value)  # greedy takes the likeliest
        assert top[token] == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(6)]
    echoed = client.completions.create(
        model=MODEL, prompt="The page cache", max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The page cache" + choice.text
    ids = tokenizer.encode("The page cache")
    echo_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert echo_ids.choices[0].text.startswith("The page cache")


def test_a_list_of_prompts_gives_one_choice_each_in_order(client: openai.OpenAI) -> None:
    prompts = ["The page cache", "A ledger of pages", "x"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage is not None and batch.usage.completion_tokens == 15
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True
    )
    texts = ["", "", ""]
    for event in stream:
        for c in event.choices:
            texts[c.index] += c.text
    assert texts == alone


def test_chat_logprobs_streamed_and_whole(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    entries, text, usage = [], "", None
    for chunk in streamed:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                entries.extend(c.logprobs.content)
    assert text == whole.choices[0].message.content
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])
    assert usage is not None and usage.completion_tokens == 8


def test_logit_bias_and_penalties_change_what_is_sampled(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    forced = client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, temperature=0, logit_bias={"300": 100}
    )
    assert forced.choices[0].text == tokenizer.decode([300] * 5)

    def tokens(**penalty: float) -> list[str]:
        done = client.completions.create(
            model=MODEL, prompt="x", max_tokens=20, temperature=0, logprobs=0,
            logit_bias={"300": 100, "301": 90}, **penalty,
        )  # fmt: skip
        return done.choices[0].logprobs.tokens  # type: ignore[union-attr, return-value]

    a, b = tokenizer.decode([300]), tokenizer.decode([301])
    assert tokens() == [a] * 20  # 300 leads by 10 whatever the model says
    # Each use of 300 costs it 2: within a few tokens 301 takes turns.
    frequency = tokens(frequency_penalty=2.0)
    assert frequency[:3] == [a] * 3 and frequency.count(b) >= 5
    # Presence costs 2 once: 300 still leads by 8.
    assert tokens(presence_penalty=2.0) == [a] * 20


BOGUS = {"name": "x", "schema": {"type": "bogus"}}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("n", {"n": 17}, "at most 16 sequences from one prompt"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "JSON schemas only"),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": BOGUS}},
     "cannot compile: Invalid type: bogus"),
    ("response_format", {"response_format": {"type": "xml"}}, "must be text, json_object or"),
    ("tool_choice", {"tool_choice": "required"}, "can only be 'none'"),
    ("service_tier", {"service_tier": "scale"}, "offers auto, default, flex, priority"),
    ("store", {"store": True}, "stores no completions"),
    ("metadata", {"metadata": {"k": "v"}}, "stores no completions"),
    ("reasoning_effort", {"reasoning_effort": "low"}, "no reasoning mode"),
    ("echo", {"extra_body": {"echo": True}}, "belongs to /v1/completions"),
    ("pages", {"extra_body": {"pages": 1}}, "has no such field"),
]  # fmt: skip


@pytest.mark.parametrize(("param", "fields", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_chat_fields_it_cannot_honour_are_refused_by_name(
    client: openai.OpenAI, param: str, fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields
        )
    body: Any = caught.value.body
    assert body["param"] == param
    assert reason in body["message"]


@pytest.mark.parametrize(
    ("param", "fields"),
    [("suffix", {"suffix": "end"}), ("best_of", {"best_of": 3}),
     ("echo", {"echo": True, "logprobs": 1}), ("messages", {"extra_body": {"messages": []}})],
)  # fmt: skip
def test_completion_fields_it_cannot_honour_are_refused_by_name(
    client: openai.OpenAI, param: str, fields: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, **fields)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_a_chat_limit_names_the_field_the_client_sent(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=99999
        )
    assert caught.value.body["param"] == "max_completion_tokens"  # type: ignore[index]


def test_latency_histograms_and_gateway_gauges(live: LiveServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    text = httpx.get(live.url + "/metrics").text
    figures = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            figures[name] = float(value)
    assert figures["kvbank_time_to_first_token_seconds_count"] >= 1
    assert figures["kvbank_time_per_output_token_seconds_count"] >= 1
    for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                  "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert gauge in figures
    live.wait_for(**{"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0})


def test_continuous_usage_stats_put_usage_in_every_chunk(live: LiveServer) -> None:
    body = {"prompt": "x", "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    counts = []
    with live.client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                counts.append(json.loads(line[len("data: ") :])["usage"]["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == 5


def test_a_json_schema_response_matches_the_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "colour"],
        "additionalProperties": False,
    }
    for seed in range(3):
        done = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=40,
            seed=seed, logprobs=True, top_logprobs=5,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        answer = json.loads(choice.message.content or "")
        assert set(answer) == {"ok", "colour"}
        assert isinstance(answer["ok"], bool) and answer["colour"] in ("red", "green", "blue")
        for entry in choice.logprobs.content or []:  # type: ignore[union-attr]
            assert all(alt.logprob > float("-inf") for alt in entry.top_logprobs)
