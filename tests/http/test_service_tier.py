"""OpenAI's `service_tier` picks a request's service class, and every response body (whole, and
each streamed chunk) says the tier it got: through the official `openai` client against
`kvbank serve` run as its own process, with its class flags."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.http.process import ServeProcess, serve_process

pytestmark = pytest.mark.slow

MODEL = "kvbank-builtin"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def strict_pool(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    flags = ("--served-model-name", MODEL)
    with serve_process(builtin_model_dir, tmp_path_factory.mktemp("serve"), *flags) as process:
        yield process


@pytest.fixture(scope="module")
def best_effort_pool(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    flags = ("--served-model-name", MODEL, "--default-class", "best-effort",
             "--max-preemptions", "1", "--victim", "cheapest")  # fmt: skip
    with serve_process(builtin_model_dir, tmp_path_factory.mktemp("serve"), *flags) as process:
        yield process


def client_of(served: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def queued(served: ServeProcess) -> dict[str, float]:
    """kvbank_class_requests_total by class: what the engine granted, read from /metrics."""
    figures = {}
    for line in httpx.get(served.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvbank_class_requests_total{"):
            name, value = line.rsplit(" ", 1)
            figures[name.split('"')[1]] = float(value)
    return figures


def chat_tier(client: openai.OpenAI, **tier: Any) -> str | None:
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **tier)
    return answer.service_tier


@pytest.mark.parametrize(
    ("asked", "echoed", "granted"),
    [
        (None, "default", "strict"),
        ("auto", "default", "strict"),
        ("default", "default", "strict"),
        ("priority", "priority", "strict"),
        ("flex", "flex", "best-effort"),
    ],
)
def test_a_strict_pool_serves_each_tier_under_its_class_and_says_so(
    strict_pool: ServeProcess, asked: str | None, echoed: str, granted: str
) -> None:
    before = queued(strict_pool)
    with client_of(strict_pool) as client:
        tier = {} if asked is None else {"service_tier": asked}
        assert chat_tier(client, **tier) == echoed
    after = queued(strict_pool)
    assert after[granted] == before[granted] + 1
    other = "strict" if granted == "best-effort" else "best-effort"
    assert after[other] == before[other]


def test_every_streamed_chunk_carries_the_tier(strict_pool: ServeProcess) -> None:
    with client_of(strict_pool) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=HI,
                max_tokens=4,
                stream=True,
                service_tier="flex",
                stream_options={"include_usage": True},
            )
        )
        assert len(chunks) >= 3 and chunks[-1].usage is not None  # role, tokens, usage
        assert {c.service_tier for c in chunks} == {"flex"}
        pieces = list(
            client.completions.create(
                model=MODEL,
                prompt="hello",
                max_tokens=4,
                stream=True,
                extra_body={"service_tier": "priority"},
            )
        )
        assert pieces and {getattr(p, "service_tier", None) for p in pieces} == {"priority"}


def test_completions_take_the_tier_too(strict_pool: ServeProcess) -> None:
    with client_of(strict_pool) as client:
        answer = client.completions.create(
            model=MODEL, prompt=["a", "b"], max_tokens=2, extra_body={"service_tier": "flex"}
        )
        assert len(answer.choices) == 2
        assert getattr(answer, "service_tier", None) == "flex"
        plain = client.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert getattr(plain, "service_tier", None) == "default"


@pytest.mark.parametrize("tier", ["scale", "FLEX", 5, ["flex"], ""])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_tier_not_offered_is_refused_naming_the_field_and_the_tiers(
    strict_pool: ServeProcess, tier: Any, route: str
) -> None:
    before = queued(strict_pool)
    with client_of(strict_pool) as client, pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, extra_body={"service_tier": tier}
            )
        else:
            client.completions.create(
                model=MODEL, prompt="a", max_tokens=2, extra_body={"service_tier": tier}
            )
    body: Any = caught.value.body
    assert body["param"] == "service_tier"
    assert "offers auto, default, flex, priority" in body["message"]
    assert queued(strict_pool) == before  # nothing was queued


@pytest.mark.parametrize(
    ("asked", "echoed", "granted"),
    [
        (None, "flex", "best-effort"),
        ("auto", "flex", "best-effort"),
        ("flex", "flex", "best-effort"),
        ("priority", "priority", "strict"),
    ],
)
def test_a_best_effort_pool_serves_untiered_requests_best_effort(
    best_effort_pool: ServeProcess, asked: str | None, echoed: str, granted: str
) -> None:
    before = queued(best_effort_pool)
    with client_of(best_effort_pool) as client:
        tier = {} if asked is None else {"service_tier": asked}
        assert chat_tier(client, **tier) == echoed
    assert queued(best_effort_pool)[granted] == before[granted] + 1


def test_n_sequences_run_strict_and_the_tier_says_so(strict_pool: ServeProcess) -> None:
    # A group of sequences is preempted whole or not at all, so the engine runs it strict
    # whatever it asks: the response says priority, not the flex it asked for.
    before = queued(strict_pool)
    with client_of(strict_pool) as client:
        answer = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, n=3, service_tier="flex"
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, n=2, service_tier="flex", stream=True
        )
        tiers = {chunk.service_tier for chunk in stream}
    assert len(answer.choices) == 3 and answer.service_tier == "priority"
    assert tiers == {"priority"}
    after = queued(strict_pool)
    assert after["strict"] == before["strict"] + 2  # one engine request per prompt
    assert after["best-effort"] == before["best-effort"]
