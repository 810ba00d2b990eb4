"""What a hostile or careless client can send, against `kvbank serve` run as its own process: a
huge body, a slow one, bytes JSON allows but nothing downstream can hold. Each gets a clear 4xx,
the server keeps answering /health, and nothing is queued."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.process import ServeProcess, serve_process

pytestmark = pytest.mark.slow

DEADLINE_S = 1.0  # the server's --header-timeout-s and --body-timeout-s here


@pytest.fixture(scope="module")
def served(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    flags = ("--header-timeout-s", str(DEADLINE_S), "--body-timeout-s", str(DEADLINE_S))
    with serve_process(builtin_model_dir, tmp_path_factory.mktemp("serve"), *flags) as process:
        yield process


def raw_post(served: ServeProcess, body: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(served.url + path, content=body, timeout=30,
                      headers={"content-type": "application/json"})  # fmt: skip


def error_of(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def read_reply(sock: socket.socket, within: float) -> bytes:
    sock.settimeout(within)
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def test_a_body_over_the_limit_gets_413_before_it_is_sent(served: ServeProcess) -> None:
    # The headers promise 20 MB and no byte of it follows: the answer cannot wait for the body.
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 20000000\r\n\r\n")  # fmt: skip
        reply = read_reply(sock, 10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large"
    assert "2097152 bytes (its --max-body-bytes)" in error["message"]


def test_a_chunked_body_over_the_limit_gets_413(served: ServeProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"x" * 65536
        yield b'"}'

    response = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=30)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


def test_health_answers_while_a_long_prompt_is_tokenized_and_refused(served: ServeProcess) -> None:
    # ~1.9 MB of text under the 2 MiB limit: seconds of tokenizing, then refused as too long.
    prompt = "the page cache holds " * 95000
    result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: result.append(
            httpx.post(served.url + "/v1/completions", json={"prompt": prompt}, timeout=120)
        )
    )
    worker.start()
    answered_during = 0
    try:
        while worker.is_alive():
            health = httpx.get(served.url + "/health", timeout=2.5)
            assert health.status_code == 200
            if worker.is_alive():
                answered_during += 1
            time.sleep(0.1)
    finally:
        worker.join(120)
    assert answered_during >= 3, "the long prompt ended before /health was tried beside it"
    assert result[0].status_code == 400
    assert error_of(result[0])["param"] == "prompt"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
         "messages[0].content"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
         "messages[0].content"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_its_field(
    served: ServeProcess, path: str, body: bytes, param: str
) -> None:
    response = raw_post(served, body, path)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert "lone UTF-16 surrogate" in str(error["message"])


def test_an_integer_of_5000_digits_is_a_400(served: ServeProcess) -> None:
    response = raw_post(served, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}")
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["code"] == "invalid_json"
    assert "digits" in str(error["message"])
    assert len(str(error["message"])) < 400  # the value is not quoted back


def test_json_nested_5000_deep_is_a_400(served: ServeProcess) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = raw_post(served, b'{"prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                            path)  # fmt: skip
        assert response.status_code == 400, response.text
        assert "nests JSON too deeply" in str(error_of(response)["message"])


def test_nan_is_not_a_number(served: ServeProcess) -> None:
    response = raw_post(served, b'{"prompt": "x", "temperature": NaN}')
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


def test_a_thousand_half_sent_requests_are_closed(served: ServeProcess) -> None:
    """Silent connections, half-sent headers and half-sent bodies: each is closed once its
    deadline passes (a begun request with a 408), and /health answers throughout."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    full_head = head + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
    kinds = [b"", head, full_head + b'{"prompt": "']  # nothing, half the headers, half a body
    socks = []
    try:
        for i in range(1000):
            sock = socket.create_connection(("127.0.0.1", served.port))
            sock.sendall(kinds[i % 3]) if kinds[i % 3] else None
            socks.append((i % 3, sock))
        assert httpx.get(served.url + "/health", timeout=5).status_code == 200
        replies: dict[int, bytes] = {}
        waiting = {sock.fileno(): (kind, sock) for kind, sock in socks}
        deadline = time.monotonic() + DEADLINE_S + 30
        while waiting and time.monotonic() < deadline:
            ready, _, _ = select.select(list(waiting), [], [], 1)
            for fd in ready:
                kind, sock = waiting[fd]
                chunk = sock.recv(65536)
                replies[fd] = replies.get(fd, b"") + chunk
                if not chunk:
                    del waiting[fd]
        assert not waiting, f"{len(waiting)} of 1000 half-sent requests still open"
        for kind, sock in socks:
            reply = replies[sock.fileno()]
            if kind == 0:
                assert reply == b""  # nothing was asked: closed without an answer
            else:
                assert reply.startswith(b"HTTP/1.1 408"), (kind, reply[:100])
                assert b"request_timeout" in reply
    finally:
        for _, sock in socks:
            sock.close()
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200


LONG_KEY = "1" * 5000  # past Python's 4,300-digit limit on int(str)


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": "x", "logit_bias": {LONG_KEY: 1}}, "logit_bias",
         "is not a token id"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100, "05": 100, "005": 100}},
         "logit_bias", "names token 5 twice"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"0" * 5000 + "7": 1}}, "logit_bias",
         None),  # leading zeros are not digits of the id: accepted as token 7
        ("/v1/completions", {"prompt": "x", "stream_options": False}, "stream_options",
         "must be an object"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options", "only to a streamed response"),
        ("/v1/completions", {"prompt": "x", "best_of": True}, "best_of", "an integer equal to n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": {}},
         "tools", "must be a list"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "text", "json_schema": {"schema": {"type": "object"}}}},
         "response_format", "a text format takes only 'type'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
         "response_format", "has field 'x'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]},
         "messages[0].content[0].cache_control", "prompt caching is automatic"),
    ],
)  # fmt: skip
def test_a_value_that_would_be_ignored_or_crash_is_a_400_naming_its_field(
    served: ServeProcess, path: str, body: dict[str, object], param: str, says: str | None
) -> None:
    response = httpx.post(served.url + path, json={"max_tokens": 1, **body}, timeout=30)
    if says is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert says in str(error["message"])
    assert len(str(error["message"])) < 600  # a bad value is quoted short
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "\\ud800"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x", "\\udfff": 1}]}', "messages[0].\\udfff"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_a_field_name_is_a_400_naming_it(
    served: ServeProcess, path: str, body: bytes, param: str
) -> None:
    response = raw_post(served, body, path)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200


def test_a_chat_too_long_for_the_model_names_messages(served: ServeProcess) -> None:
    long = {"role": "user", "content": "the page cache holds " * 1200}
    response = httpx.post(served.url + "/v1/chat/completions",
                          json={"messages": [long], "max_tokens": 1}, timeout=60)  # fmt: skip
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "messages"


def test_a_chunk_declared_over_the_limit_gets_413_at_once(served: ServeProcess) -> None:
    # The chunk header promises 2**48 bytes; the answer cannot wait for them (nor for the body
    # deadline, which would make it a 408).
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ntransfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % (1 << 48)
                     + b'{"prompt": ')  # fmt: skip
        started = time.monotonic()
        reply = read_reply(sock, 10)
    assert time.monotonic() - started < DEADLINE_S, "answered only at the body deadline"
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large"
    assert "limit of 2097152 bytes for the whole body" in error["message"]
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200


WRITE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16


@pytest.fixture(scope="module")
def bounded(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """A server started under a soft open-files limit of 512, with a short write deadline, a
    small connection cap, and pages for a long stream (8,000 tokens)."""
    flags = ("--write-timeout-s", str(WRITE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
             "--pages", "512")  # fmt: skip
    with serve_process(builtin_model_dir, tmp_path_factory.mktemp("bounded"), *flags,
                       soft_open_files=512) as process:  # fmt: skip
        yield process


def figure(served: ServeProcess, name: str) -> float:
    for line in httpx.get(served.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_freed(
    bounded: ServeProcess,
) -> None:
    # A long stream with fat chunks (20 alternatives per token) into a socket that reads
    # nothing: loopback's buffers (a few MB) fill within about 4,000 of the 8,000 tokens asked.
    body = json.dumps({"prompt": "Hello", "max_tokens": 2000, "n": 4, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()  # fmt: skip
    before = figure(bounded, "kvbank_generated_tokens_total")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", bounded.port))
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while figure(bounded, "kvbank_running_requests") == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        started = time.monotonic()
        while figure(bounded, "kvbank_running_requests") != 0:
            assert time.monotonic() < deadline, "the stalled request still runs"
            time.sleep(0.1)
        generated = figure(bounded, "kvbank_generated_tokens_total") - before
        assert generated < 8000, "it ran to its end: nothing dropped it"
        assert time.monotonic() - started < 30
        # The server closed the connection: what was buffered reads out, then EOF.
        sock.settimeout(10)
        while sock.recv(65536):
            pass
    finally:
        sock.close()
    assert httpx.get(bounded.url + "/health", timeout=5).status_code == 200


def test_connections_over_the_cap_get_503_and_are_closed_at_once(bounded: ServeProcess) -> None:
    socks = [socket.create_connection(("127.0.0.1", bounded.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", bounded.port)) as extra:
            reply = read_reply(extra, 5)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), reply[:200]
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert f"limit of {MAX_CONNECTIONS} connections" in error["message"]
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the closed ones are counted out as the server sees them go
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(bounded.url + "/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "the server never answered again"
        time.sleep(0.1)


def test_the_open_files_soft_limit_is_raised_to_the_hard_one(bounded: ServeProcess) -> None:
    line = next(row for row in Path(f"/proc/{bounded.process.pid}/limits").read_text().splitlines()
                if row.startswith("Max open files"))  # fmt: skip
    soft, hard = line.split()[3:5]
    assert soft == hard != "512", line
