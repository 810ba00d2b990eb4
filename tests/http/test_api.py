"""The OpenAI-compatible API against a real server: shapes, errors, streaming, refusal, 429 and
client disconnects."""

from __future__ import annotations

import json
import threading

import httpx

from tests.http.conftest import LiveServer


def _error(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def test_models_health_and_a_greedy_completion(server: LiveServer) -> None:
    assert server.client.get("/health").json() == {"status": "ok"}
    models = server.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["kvbank-builtin"]
    body = {
        "model": "kvbank-builtin",
        "prompt": "The page cache",
        "max_tokens": 9,
        "temperature": 0,
    }
    first = server.client.post("/v1/completions", json=body).json()
    again = server.client.post("/v1/completions", json=body).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 9
    assert first["usage"]["prompt_tokens"] == 4  # <s> + three tokens
    assert first["choices"][0]["text"] == again["choices"][0]["text"]  # greedy is deterministic


def test_streamed_chat_equals_the_unstreamed_answer(server: LiveServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = server.client.post("/v1/chat/completions", json=body).json()
    text = whole["choices"][0]["message"]["content"]
    chunks = []
    with server.client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_text_before_it(server: LiveServer) -> None:
    body = {"prompt": "The page cache", "max_tokens": 30, "temperature": 0}
    full = server.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[10:13]
    cut = server.client.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_malformed_and_out_of_range_requests_name_the_field(server: LiveServer) -> None:
    cases = [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), "model"),
        (json.dumps({"prompt": "x", "max_tokens": "10"}).encode(), "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 5000}).encode(), "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": 3}).encode(), "temperature"),
        (json.dumps({"prompt": "x", "top_p": True}).encode(), "top_p"),
        (json.dumps({"prompt": "x", "n": 17}).encode(), "n"),
        (json.dumps({"prompt": "x", "n": 0}).encode(), "n"),
        (json.dumps({"prompt": "x", "n": "2"}).encode(), "n"),
        (json.dumps({"prompt": [1, 99999]}).encode(), "prompt"),
        (json.dumps({"prompt": ""}).encode(), "prompt"),
        (json.dumps({"max_tokens": 3}).encode(), "prompt"),
        (json.dumps({"prompt": "x", "stop": 5}).encode(), "stop"),
    ]
    for raw, param in cases:
        response = server.client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, raw
        error = _error(response)
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (raw, error)
    chat = server.client.post("/v1/chat/completions", json={"messages": [{"role": "robot"}]})
    assert chat.status_code == 400 and _error(chat)["param"] == "messages[0].content"
    roles = server.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}
    )
    assert roles.status_code == 400 and "roles must be" in str(_error(roles)["message"])
    server.wait_for(kvbank_running_requests=0, kvbank_waiting_requests=0)


def test_a_request_the_pool_can_never_hold_is_refused_with_what_to_change(
    server: LiveServer,
) -> None:
    response = server.client.post(
        "/v1/completions", json={"prompt": [0, 5, 6, 7], "max_tokens": 1500}
    )
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "max_tokens"
    assert "needs 94 KV pages (4 prompt tokens + 1500 max_tokens" in str(error["message"])
    assert "the pool holds 63 pages" in str(error["message"])
    assert "lower max_tokens to at most 1004" in str(error["message"])
    assert "raise the pool to at least 95 pages" in str(error["message"])
    # A client's own page figures never reach the ledger: each is refused, naming it.
    for lie in ("pages", "kv_pages", "reserved_pages", "num_pages", "page_count"):
        response = server.client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, lie: 100000}
        )
        assert response.status_code == 400
        assert _error(response)["param"] == lie
        assert _error(response)["code"] == "unsupported_parameter"
    fine = server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert fine.status_code == 200


def test_a_refusal_blames_the_parameter_to_change_as_the_client_named_it(
    server: LiveServer,
) -> None:
    # 1100 prompt tokens + 1 output token need 69 pages of the 63: no max_tokens fits, and the
    # message still counts "1 max_tokens", which the parameter must not be read from.
    long_prompt = server.client.post(
        "/v1/completions", json={"prompt": [5] * 1100, "max_tokens": 1}
    )
    assert long_prompt.status_code == 400
    error = _error(long_prompt)
    assert error["param"] == "prompt" and "shorten the prompt" in str(error["message"])
    messages = [{"role": "user", "content": "x"}]
    for named in ("max_completion_tokens", "max_tokens"):
        chat = server.client.post("/v1/chat/completions", json={"messages": messages, named: 1500})
        assert chat.status_code == 400 and _error(chat)["param"] == named, chat.text
    server.wait_for(kvbank_running_requests=0, kvbank_waiting_requests=0)
    server.wait_for(kvbank_running_requests=0, kvbank_outstanding_pages=0)


def test_queue_bound_answers_429_and_a_disconnect_frees_the_pages(server: LiveServer) -> None:
    """A long stream runs; a second request that cannot fit beside it waits; a third finds the
    queue at its bound (1) and gets 429 with Retry-After, nothing queued. Closing the first
    stream aborts it: the waiting one runs, and once it is cut too the pool is back to idle."""
    long_request = {"prompt": [0, 11, 12, 13], "max_tokens": 600, "temperature": 0, "stream": True}
    idle = server.wait_for(kvbank_running_requests=0)
    aborted_before = idle.get('kvbank_requests_total{outcome="aborted"}', 0.0)
    with (
        httpx.Client(base_url=server.url, timeout=60) as first_client,
        first_client.stream("POST", "/v1/completions", json=long_request) as first,
    ):
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # it is generating
        second_status: list[int] = []
        second_thread = threading.Thread(
            target=lambda: second_status.append(
                httpx.post(
                    f"{server.url}/v1/completions",
                    json={**long_request, "stream": False},
                    timeout=120,
                ).status_code
            )
        )
        second_thread.start()
        server.wait_for(kvbank_running_requests=1, kvbank_waiting_requests=1)
        third = server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert _error(third)["code"] == "queue_full"
        assert server.figures()["kvbank_waiting_requests"] == 1  # the 429 queued nothing
    # The first stream is closed here: its request is aborted and the second one admitted.
    second_thread.join(120)
    assert second_status == [200]
    figures = server.wait_for(
        kvbank_running_requests=0,
        kvbank_waiting_requests=0,
        kvbank_pool_held_pages=0,
        kvbank_outstanding_pages=0,
    )
    assert figures['kvbank_requests_total{outcome="aborted"}'] == aborted_before + 1
    assert figures["kvbank_pool_free_pages"] + figures["kvbank_pool_evictable_pages"] == 63


def test_a_seeded_sampled_request_is_reproducible(server: LiveServer) -> None:
    body = {"prompt": "The page cache", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9}
    texts = [
        server.client.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0][
            "text"
        ]
        for seed in (5, 5, 6)
    ]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_every_end_of_turn_id_of_the_config_stops_a_request() -> None:
    """Llama 3 lists three end ids; the engine stops at the tokenizer's, the API at the rest."""
    from types import SimpleNamespace

    from kvbank.engine.serve.command import extra_stop_ids

    stack = SimpleNamespace(
        tokenizer=SimpleNamespace(eos_token_id=128009),
        config=SimpleNamespace(eos_token_ids=(128001, 128008, 128009)),
    )
    assert extra_stop_ids(stack) == (128001, 128008)  # type: ignore[arg-type]


def test_a_batch_of_prompts_is_queued_whole_or_not_at_all(server: LiveServer) -> None:
    """Behind a request that holds the whole pool, a batch of two finds room in the queue (its
    bound is 1) for its first prompt only: the answer is 429 and the first is taken back."""
    holder = {"prompt": [0, 11, 12, 13], "max_tokens": 1000, "temperature": 0, "stream": True}
    server.wait_for(kvbank_running_requests=0, kvbank_waiting_requests=0)
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=holder) as first,
    ):
        lines = first.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        server.wait_for(kvbank_running_requests=1)
        batch = server.client.post(
            "/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 600}
        )
        assert batch.status_code == 429
        assert _error(batch)["code"] == "queue_full"
        server.wait_for(kvbank_running_requests=1, kvbank_waiting_requests=0)
    server.wait_for(kvbank_running_requests=0, kvbank_outstanding_pages=0)
