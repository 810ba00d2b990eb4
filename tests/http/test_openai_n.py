"""n > 1 through the official `openai` client against a real server: n choices per prompt, in
OpenAI's order, sharing the prompt's pages under one admission; streamed interleaved by index;
the prompt counted once in usage; bad values refused naming `n`; a client that leaves aborts
all n."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.http.conftest import LiveServer

MODEL = "kvbank-builtin"
CHAT = [{"role": "user", "content": "Name a page"}]


def test_n_seeded_choices_are_distinct_reproducible_and_the_prompt_counts_once(
    client: openai.OpenAI,
) -> None:
    def ask(n: int) -> Any:
        return client.completions.create(
            model=MODEL, prompt="The page cache", max_tokens=8, temperature=1.0, seed=7, n=n
        )

    three = ask(3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) > 1  # seeds 7, 8, 9
    assert [c.text for c in ask(3).choices] == texts
    one = ask(1)
    assert one.choices[0].text == texts[0]  # sequence 0 samples with the request's own seed
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # once, not three times
    assert three.usage.completion_tokens == 3 * 8
    assert three.usage.total_tokens == three.usage.prompt_tokens + 24


def test_greedy_choices_equal_the_lone_greedy_answer(client: openai.OpenAI) -> None:
    lone = client.completions.create(model=MODEL, prompt="A ledger", max_tokens=6, temperature=0)
    many = client.completions.create(
        model=MODEL, prompt="A ledger", max_tokens=6, temperature=0, n=4, best_of=4
    )
    assert [c.text for c in many.choices] == [lone.choices[0].text] * 4
    assert all(c.finish_reason == "length" for c in many.choices)


def test_a_list_of_prompts_times_n_gives_choices_in_openai_order(client: openai.OpenAI) -> None:
    prompts = ["The page cache", "A ledger of pages", "x"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    batch = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2, echo=True
    )
    assert [c.index for c in batch.choices] == list(range(6))
    # choice i * n + j is prompt i's sequence j; echo puts each prompt first in its choices
    expected = [p + a for p, a in zip(prompts, alone, strict=True) for _ in range(2)]
    assert [c.text for c in batch.choices] == expected
    assert batch.usage is not None and batch.usage.completion_tokens == 6 * 4


def test_a_stream_interleaves_each_choices_chunks_by_index(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, prompt="Pages", max_tokens=10, temperature=0.9)
    whole = client.completions.create(**fields, seed=3, n=3)
    stream = client.completions.create(
        **fields, seed=3, n=3, stream=True, stream_options={"include_usage": True}
    )
    texts, order, usage, finishes = ["", "", ""], [], None, {}
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        for c in event.choices:
            texts[c.index] += c.text
            order.append(c.index)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved as the tokens come, not choice after choice
    assert usage is not None and usage.completion_tokens == 30
    assert whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n_with_logprobs_and_penalties(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0.8, seed=11, n=2,
        logprobs=True, top_logprobs=2, frequency_penalty=1.0,
    )  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1]
    for choice in done.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0.8, seed=11, n=2, stream=True,
        frequency_penalty=1.0,
    )  # fmt: skip
    texts = ["", ""]
    for event in stream:
        for c in event.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in done.choices]


def test_a_stop_string_ends_only_the_choice_that_reaches_it(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, prompt="Stop here", max_tokens=12, seed=5)
    free = client.completions.create(**fields, temperature=1.0, n=3)
    first = free.choices[0].text
    stop = first[2:5] if len(first) >= 5 else first
    cut = client.completions.create(**fields, temperature=1.0, n=3, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == first[: first.index(stop)]
    for before, after in zip(free.choices[1:], cut.choices[1:], strict=True):
        if stop not in before.text:
            assert after.text == before.text and after.finish_reason == "length"


BAD_N = [
    ({"n": 0}, "must be at least 1"),
    ({"n": 17}, "at most 16 sequences from one prompt"),
    ({"n": "2"}, "must be an integer"),
    ({"n": 2.5}, "must be an integer"),
    ({"n": 16, "prompt": ["a", "b", "c", "d", "e"]}, "80 choices; at most 64"),
]


@pytest.mark.parametrize(("fields", "reason"), BAD_N, ids=[json.dumps(f) for f, _ in BAD_N])
def test_bad_values_of_n_are_refused_naming_n(
    live: LiveServer, fields: dict[str, Any], reason: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}
    response = live.client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n"
    assert reason in error["message"]


def test_best_of_other_than_n_stays_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, best_of=3)
    assert caught.value.body["param"] == "best_of"  # type: ignore[index]


def test_a_group_the_pool_can_never_hold_is_refused_naming_n(client: openai.OpenAI) -> None:
    # 63 usable pages at 16 tokens: a 100-token prompt with 400 max_tokens is 32 pages alone;
    # two sequences share 6 of them (58 pages), three would need 84.
    prompt = [11] * 100
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert two.usage is not None and two.usage.completion_tokens == 800
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, n=3)
    body: Any = caught.value.body
    assert body["param"] == "n"
    assert "needs 84 KV pages" in body["message"]
    assert "lower n to at most 2" in body["message"]


def test_a_client_that_leaves_aborts_every_sequence(live: LiveServer) -> None:
    before = live.settled()
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 300, "n": 3, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # the first token is out: leave
    after = live.settled()
    aborted = 'kvbank_requests_total{outcome="aborted"}'
    assert after[aborted] - before.get(aborted, 0) == 3
    assert after["kvbank_pool_held_pages"] == 0
    assert after["kvbank_pool_free_pages"] + after["kvbank_pool_evictable_pages"] == 63
