"""Helpers for tests that start real `kvbank serve` processes and talk to them over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The page cache", "A ledger of requests", "x", "Many people serve the model"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What places a `kvbank serve` in a group across pods (kvbank.engine.tp.pod); a test runner that
# happens to carry them must not turn every engine a test starts into one rank.
PLACEMENT = ("KVBANK_RANK", "KVBANK_WORLD_SIZE", "KVBANK_RANK0_ADDR", "KVBANK_DIST_PORT")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, less any placement, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in PLACEMENT}
    return {**env, "PYTHONPATH": str(ROOT), **(extra or {})}


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"a rank exited early with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def answers(url: str) -> list[str]:
    """Greedy completions of PROMPTS (batched together), of three prompts sharing a prefix
    (one after another, so the later ones hit the prefix cache) and of one with n = 3."""

    def ask(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together, as a server would
        said = list(pool.map(ask, PROMPTS))
    # The follower must replay rank 0's pinned hits exactly.
    shared = "The ledger admits a request only if every admitted request can finish. " * 3
    said += [ask(shared + tail) for tail in ("First.", "Second one.", "First.")]
    # Three sequences of one prompt (n = 3): the follower replays the group's rows too.
    body = {"prompt": shared + "Third.", "max_tokens": 16, "temperature": 0, "n": 3}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    group = [str(choice["text"]) for choice in response.json()["choices"]]
    assert group == [ask(shared + "Third.")] * 3
    return said + group


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
