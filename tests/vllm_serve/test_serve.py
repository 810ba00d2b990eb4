"""`vllm serve` with kvbank's scheduler class (embedded ledger) and stock vLLM, side by side on
one small random-weight Llama, through the official `openai` client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from vllm_server import MODEL_NAME, VllmServer, start_all

pytestmark = pytest.mark.timeout(600)

# 16 blocks of 128 tokens; vLLM keeps one back, so 15 hold requests: 1920 tokens, which is
# also the longest request vLLM accepts (it refuses to start with a longer max_model_len).
BLOCKS = 16
MAX_MODEL_LEN = 1920
PROMPTS = [
    "the page cache",
    "a request for the ledger",
    "admission of one more prompt",
    "Decode the batch, then prefill",
    "what the pool can hold",
    "Many people work here every day.",
    "model serve engine",
    "two three year old",
]


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    logs = tmp_path_factory.mktemp("vllm-serve")
    common = {"blocks": BLOCKS, "max_model_len": MAX_MODEL_LEN}
    both = start_all(
        [
            VllmServer(
                model_dir,
                logs / "kvbank.log",
                kvbank=True,
                env={"KVBANK_POLICY": "peak+backfill"},
                **common,
            ),
            VllmServer(model_dir, logs / "stock.log", kvbank=False, **common),
        ]
    )
    yield both
    for server in both:
        server.stop()


@pytest.fixture(scope="module")
def kvbank(servers: list[VllmServer]) -> VllmServer:
    return servers[0]


@pytest.fixture(scope="module")
def stock(servers: list[VllmServer]) -> VllmServer:
    return servers[1]


def greedy(server: VllmServer, max_tokens: int = 16) -> list[tuple[str, list[int]]]:
    """One batched completion of every prompt at temperature 0: (text, token ids) each."""
    reply = server.client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choices = sorted(reply.choices, key=lambda c: c.index)
    return [(c.text, list(getattr(c, "token_ids", None) or [])) for c in choices]


def test_a_completion_is_served_through_kvbanks_scheduler(kvbank: VllmServer) -> None:
    assert "Using custom scheduler class kvbank.vllm.KvbankScheduler" in kvbank.log_text()
    reply = kvbank.client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 16


def test_a_chat_completion_renders_the_models_chat_template(kvbank: VllmServer) -> None:
    reply = kvbank.client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You serve tokens."},
            {"role": "user", "content": "the page cache"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12
    # <s>, two role headers of the template and the assistant's: more than the words alone.
    assert reply.usage.prompt_tokens > 8


def test_streaming_sends_the_same_tokens_as_one_reply(kvbank: VllmServer) -> None:
    whole = kvbank.client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0
    )
    chunks = list(
        kvbank.client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True
        )
    )
    assert len(chunks) > 1  # token by token, not one reply in one chunk
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    chat = kvbank.client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(deltas)


def test_a_prompt_the_pool_can_never_hold_is_a_400_naming_the_prompt(kvbank: VllmServer) -> None:
    # vLLM caps max_model_len at what the pool holds, so its front end refuses before the
    # request reaches kvbank's ledger; the reply says which parameter to change.
    with pytest.raises(openai.BadRequestError) as refused:
        kvbank.client.completions.create(
            model=MODEL_NAME, prompt="the " * (MAX_MODEL_LEN + 100), max_tokens=4
        )
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "input_tokens"  # type: ignore[index]
    assert "reduce the length of the input prompt" in refused.value.message


def test_max_tokens_past_what_the_pool_holds_is_a_400_naming_max_tokens(
    kvbank: VllmServer,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        kvbank.client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN + 1
        )
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert f"max_model_len={MAX_MODEL_LEN}" in refused.value.message


def test_greedy_tokens_equal_stock_vllms(kvbank: VllmServer, stock: VllmServer) -> None:
    ours, theirs = greedy(kvbank), greedy(stock)
    assert [ids for _, ids in ours] == [ids for _, ids in theirs]
    assert all(len(ids) == 16 for _, ids in ours)
    assert [text for text, _ in ours] == [text for text, _ in theirs]


def press(
    server: VllmServer,
    requests: int,
    max_tokens: int,
    flex: frozenset[int] = frozenset(),
    prefixes: tuple[str, ...] = ("",),
) -> list[list[int]]:
    """`requests` concurrent completions that all run to `max_tokens` (ignore_eos, greedy);
    the token ids each got. Those numbered in `flex` ask to be best-effort; request i's prompt
    starts with `prefixes[i % len(prefixes)]`."""

    def one(i: int) -> list[int]:
        extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
        if i in flex:
            extra["vllm_xargs"] = {"service_tier": "flex"}
        reply = server.client.completions.create(
            model=MODEL_NAME,
            prompt=f"{prefixes[i % len(prefixes)]}{i} {PROMPTS[i % len(PROMPTS)]} {i}",
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra,
        )
        return list(getattr(reply.choices[0], "token_ids", None) or [])

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(one, range(requests)))


def test_under_kv_pressure_stock_vllm_preempts_and_kvbank_never_does(
    kvbank: VllmServer, stock: VllmServer
) -> None:
    # Twelve requests of about 3 blocks each at their end: 36 blocks wanted of 15.
    requests, max_tokens = 12, 320
    results = {}
    for name, server in (("stock", stock), ("kvbank", kvbank)):
        before = server.metric("vllm:num_preemptions_total")
        start = time.monotonic()
        served = press(server, requests, max_tokens)
        seconds = time.monotonic() - start
        results[name] = (served, server.metric("vllm:num_preemptions_total") - before)
        print(f"{name}: {results[name][1]:.0f} preemptions, {seconds:.1f} s")
    stock_served, stock_preemptions = results["stock"]
    kvbank_served, kvbank_preemptions = results["kvbank"]
    assert [len(ids) for ids in kvbank_served] == [max_tokens] * requests
    assert stock_preemptions > 0, "the pool was not under pressure: stock vLLM never preempted"
    assert kvbank_preemptions == 0, f"kvbank's admission let vLLM preempt {kvbank_preemptions}"
    # Stock vLLM recomputed what it preempted; the greedy tokens are the same all the same.
    assert kvbank_served == stock_served


def test_best_effort_requests_run_beside_strict_ones_and_only_they_are_preempted(
    kvbank: VllmServer,
) -> None:
    # Six best-effort sequences and six strict requests: the strict ones are admitted by the
    # ledger and never preempted; the best-effort ones run on what they leave and are taken
    # back, then promoted after KVBANK_MAX_PREEMPTIONS (kvbank/vllm/classes.py), so every
    # request finishes. The pressure does not rest on when requests arrive: the best-effort
    # six are one request's `n` (vLLM adds them to its scheduler together, not one HTTP
    # request at a time), each running to 1,400 tokens, 12 of the 15 blocks, so no two of them
    # can keep their pages to the end. Six separate requests of 320 tokens once arrived far
    # enough apart on a loaded machine that each finished before the next grew (CI, twice).
    flex_n, flex_tokens, strict, max_tokens = 6, 1400, 6, 320
    before = kvbank.metric("vllm:num_preemptions_total")

    def best_effort() -> list[int]:
        reply = kvbank.client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[3],
            n=flex_n,
            max_tokens=flex_tokens,
            temperature=1.0,
            seed=0,
            extra_body={"ignore_eos": True, "vllm_xargs": {"service_tier": "flex"}},
        )
        assert reply.usage is not None
        return [reply.usage.completion_tokens, len(reply.choices)]

    with ThreadPoolExecutor(1) as pool:
        flex = pool.submit(best_effort)
        # The strict ones meet a pool the best-effort ones hold.
        deadline = time.monotonic() + 60
        while kvbank.metric("vllm:num_requests_running") < flex_n and not flex.done():
            assert time.monotonic() < deadline, "the best-effort sequences never ran"
            time.sleep(0.05)
        served = press(kvbank, strict, max_tokens)
        flex_served = flex.result()
    preempted = kvbank.metric("vllm:num_preemptions_total") - before
    print(f"kvbank, {flex_n} best-effort beside {strict} strict: {preempted:.0f} preemptions")
    assert flex_served == [flex_n * flex_tokens, flex_n]
    assert [len(ids) for ids in served] == [max_tokens] * strict
    assert "which kvbank admitted" not in kvbank.log_text()
    assert preempted > 0, "no best-effort request was preempted: the pool was not under pressure"
