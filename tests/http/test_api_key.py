"""`kvbank serve --api-key-file`: /v1/* needs a key, /health and /metrics stay open. The same
server is named by its model folder's path (--served-model-name), as benchmark tools that load a
tokenizer by the served model's id need."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.http.process import REPO, ServeProcess, serve_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("keys")
    keys = folder / "api-key"
    keys.write_text("# the team's keys\n\nsk-first\n  sk-second  \n")
    flags = ("--api-key-file", str(keys), "--served-model-name", str(builtin_model_dir))
    with serve_process(builtin_model_dir, folder, *flags) as process:
        yield process


@pytest.mark.parametrize("key", ["sk-first", "sk-second"])
def test_a_listed_key_is_served(guarded: ServeProcess, key: str) -> None:
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=key, max_retries=0) as client:
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="x", max_tokens=2)
        assert done.usage is not None and done.usage.completion_tokens == 2


@pytest.mark.parametrize("key", ["sk-wrong", "sk-firs", "# the team's keys"])
def test_a_wrong_key_gets_an_openai_style_401(guarded: ServeProcess, key: str) -> None:
    with (
        openai.OpenAI(base_url=guarded.url + "/v1", api_key=key, max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "message": "the API key given is not one this server accepts",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_no_key_gets_401_before_the_body_is_read(guarded: ServeProcess) -> None:
    # The body is refused unread: even one over the size limit gets 401, not 413.
    response = httpx.post(guarded.url + "/v1/completions", content=b"x" * (3 << 20))
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert "Authorization: Bearer KEY" in error["message"]
    assert (
        httpx.get(guarded.url + "/v1/models", headers={"authorization": "Basic eA=="}).status_code
        == 401
    )


def test_health_and_metrics_stay_open(guarded: ServeProcess) -> None:
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert "kvbank_pool_pages" in httpx.get(guarded.url + "/metrics").text


@pytest.mark.parametrize(
    ("content", "message"), [(None, "cannot read it"), ("# none\n\n", "holds no key")]
)
def test_a_key_file_that_is_missing_or_empty_stops_serve_at_start(
    tmp_path: Path, content: str | None, message: str
) -> None:
    keys = tmp_path / "api-key"
    if content is not None:
        keys.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "serve", "--api-key-file", str(keys)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--api-key-file {keys}" in done.stderr and message in done.stderr


def test_a_path_like_model_name_lets_clients_load_the_tokenizer(
    guarded: ServeProcess, builtin_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-first", max_retries=0) as client:
        card = client.models.list().data[0]
        assert card.id == str(builtin_model_dir)
        assert client.models.retrieve(card.id).id == card.id  # a path is a route's tail too
        tokenizer = AutoTokenizer.from_pretrained(card.id)  # what benchmark tools do
        ids = tokenizer("The page cache")["input_ids"]
        done = client.completions.create(model=card.id, prompt=ids, max_tokens=2)
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)
