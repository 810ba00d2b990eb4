"""`kvbank serve --sidecar`: the same answers when a real sidecar process decides admission."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvbank.engine.serve.stack import ServeOptions, build_stack
from tests.http.conftest import SMALL_POOL, LiveServer, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", f"127.0.0.1:{port}",
               "--metrics-port", "-1"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"the sidecar exited with {proc.returncode}"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < deadline, "the sidecar never listened"
        time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(15)


def _live(options: ServeOptions, model_dir: Path) -> tuple[LiveServer, object, object]:
    from kvbank.engine.serve.command import build_server

    stack = build_stack(options, model_dir=model_dir)
    port = free_port()
    http, loop = build_server(stack, "127.0.0.1", port)
    loop.start()
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    return LiveServer(url, httpx.Client(base_url=url, timeout=60), loop), http, loop


def test_answers_through_the_sidecar_equal_the_embedded_ledger(
    sidecar: str, builtin_model_dir: Path
) -> None:
    prompts = ["The page cache", "x", "A ledger of requests", "Many people"]
    answers = []
    roomy = dataclasses.replace(SMALL_POOL, max_waiting=16)
    for options in (roomy, dataclasses.replace(roomy, sidecar=sidecar)):
        live, http, loop = _live(options, builtin_model_dir)
        try:

            def ask(prompt: str, live: LiveServer = live) -> str:
                body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
                response = live.client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return str(response.json()["choices"][0]["text"])

            with ThreadPoolExecutor(len(prompts)) as pool:
                answers.append(list(pool.map(ask, prompts)))
            live.wait_for(kvbank_running_requests=0, kvbank_outstanding_pages=0)
        finally:
            http.should_exit = True  # type: ignore[attr-defined]
            loop.stop()  # type: ignore[attr-defined]
            live.client.close()
    assert answers[0] == answers[1]


def test_a_missing_sidecar_factory_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbank.engine.serve.stack as stack

    real = stack.importlib.import_module

    def without_backend(name: str) -> object:
        if name == "kvbank.sidecar.backend":
            raise ImportError("No module named 'kvbank.sidecar.backend'")
        return real(name)

    monkeypatch.setattr(stack.importlib, "import_module", without_backend)
    with pytest.raises(ValueError, match="run without --sidecar to admit with the embedded"):
        stack.sidecar_backend("127.0.0.1:1", 64)
