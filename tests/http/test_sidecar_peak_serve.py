"""`kvbank serve --sidecar --policy peak(+backfill)`: a real sidecar process running the
peak-fit ledger gives the same answers as the in-process one."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvbank.engine.serve.stack import ServeOptions, build_stack
from kvbank.sidecar.client import SidecarClient
from tests.http.conftest import SMALL_POOL, LiveServer, free_port

ROOT = Path(__file__).resolve().parents[2]


def _sidecar(policy: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", f"127.0.0.1:{port}",
               "--metrics-port", "-1", "--debug", "--policy", policy]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"the sidecar exited with {proc.returncode}"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        assert time.monotonic() < deadline, "the sidecar never listened"
        time.sleep(0.1)


def _answers(options: ServeOptions, model_dir: Path, prompts: list[str]) -> list[str]:
    from kvbank.engine.serve.command import build_server

    stack = build_stack(options, model_dir=model_dir)
    port = free_port()
    http, loop = build_server(stack, "127.0.0.1", port)
    loop.start()
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    live = LiveServer(url, httpx.Client(base_url=url, timeout=60), loop)
    try:

        def ask(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            response = live.client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        live.wait_for(kvbank_running_requests=0)
        return answers
    finally:
        http.should_exit = True
        loop.stop()
        live.client.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["peak", "peak+backfill"])
def test_answers_through_a_peak_sidecar_equal_the_in_process_ledger(
    policy: str, builtin_model_dir: Path
) -> None:
    prompts = ["The page cache", "x", "A ledger of requests", "Many people"]
    options = dataclasses.replace(SMALL_POOL, max_waiting=16, policy=policy)
    local = _answers(options, builtin_model_dir, prompts)
    proc, address = _sidecar(policy)
    try:
        remote = _answers(dataclasses.replace(options, sidecar=address), builtin_model_dir, prompts)
        with SidecarClient(address) as client:
            served = client.status_reply()
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
    assert remote == local
    assert served.next_seq == len(prompts)  # the sidecar decided every admission
