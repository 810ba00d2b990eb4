"""`kvbank serve --sidecar` when its sidecar goes away, with real processes on loopback: the
sidecar SIGKILLed under streaming load and restarted on the same address, and the start-up
refusals of a sidecar started for another pool and of a flag that contradicts `--pool`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvbank.sidecar.client import PoolStatus, SidecarClient
from tests.http.conftest import free_port

pytestmark = pytest.mark.timeout(150)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
POOL_PAGES = 768
# A pool the built-in model serves on CPU: 768 pages of 16 tokens, five worst cases at once.
POOL = f"""\
apiVersion: kvbank.dev/v1alpha1
kind: ModelPool
metadata: {{name: tiny, namespace: test}}
spec:
  model:
    name: kvbank-builtin
    architecture: {{layers: 2, attentionHeads: 4, kvHeads: 2, headDim: 16, parameters: 1.0e6,
                   dtype: float32}}
  gpu: {{memoryGiB: 1}}
  kv: {{pageSize: 16, pages: {POOL_PAGES}}}
  kvSlots:
    main: {{prompt: 1, output: 1}}
  limits: {{maxSeqLen: 2048, maxTokens: 1900}}
"""
STREAM_TOKENS = 1800  # long enough to outlive the kill, the restart and the reconnect
STREAMS = 3


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL)
    return path


def start_sidecar(address: str, pool: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", address,
            "--metrics-port", "-1", "--pool", str(pool), "--debug"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    deadline = time.monotonic() + 30
    with SidecarClient(address, retry_budget_s=0.2) as client:
        while True:
            assert proc.poll() is None, f"the sidecar exited {proc.returncode}: {log.read_text()}"
            with contextlib.suppress(Exception):
                client.status_reply()
                return proc
            assert time.monotonic() < deadline, "the sidecar never answered"
            time.sleep(0.1)


def serve_argv(model_dir: Path, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model_dir),
            "--port", str(port), "--max-batch-tokens", "256", *flags]  # fmt: skip


@contextlib.contextmanager
def serving(argv: list[str], log: Path) -> Iterator[str]:
    port = argv[argv.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"kvbank serve exited {proc.returncode}:\n{log.read_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"kvbank serve never answered:\n{log.read_text()}"
            time.sleep(0.2)
        yield url
        assert proc.poll() is None, f"kvbank serve exited {proc.returncode}:\n{log.read_text()}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Stream:
    """One streaming completion read in a thread: its chunks, how it finished, its usage."""

    url: str
    chunks: int = 0
    finish: str | None = None
    completion_tokens: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"prompt": "The ledger", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]["message"]
                    for choice in event.get("choices", []):
                        self.chunks += 1
                        self.finish = choice["finish_reason"] or self.finish
                    if event.get("usage"):
                        self.completion_tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.done.set()


def streams_to_the_end(stream: Stream, stall_s: float = 30.0) -> bool:
    """Whether the stream ends, waited on while it still streams: a busy machine serves it
    slowly (TP 2 on two cores), a request the outage lost not at all."""
    seen = -1
    while not stream.done.wait(stall_s):
        if stream.chunks == seen:
            return False
        seen = stream.chunks
    return True


def engine_running(url: str) -> int:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvbank_running_requests "):
            return int(float(line.split()[1]))
    raise AssertionError("no kvbank_running_requests gauge")


def settled_status(client: SidecarClient, within: float = 10) -> PoolStatus:
    deadline = time.monotonic() + within
    while True:
        status = client.status()
        if (status.running, status.waiting, status.reserved, status.outstanding) == (0, 0, 0, 0):
            return status
        assert time.monotonic() < deadline, f"the sidecar still holds reservations: {status}"
        time.sleep(0.1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sidecar_killed_under_load_drains_the_engine_and_a_restart_serves_again(
    builtin_model_dir: Path, pool_file: Path, tmp_path: Path, tp: int
) -> None:
    """Under tensor parallelism rank 0 alone talks to the sidecar; its followers replay its
    answers, so the outage, the drain and the reconnect are rank 0's, and the ranks stay in
    step through them (a follower out of step would stop every rank)."""
    address = f"127.0.0.1:{free_port()}"
    sidecar_log, serve_log = tmp_path / "sidecar.log", tmp_path / "serve.log"
    sidecars = [start_sidecar(address, pool_file, sidecar_log)]
    argv = serve_argv(builtin_model_dir, free_port(), "--pool", str(pool_file),
                      "--sidecar", address, "--tp", str(tp))  # fmt: skip
    try:
        with serving(argv, serve_log) as url, SidecarClient(address) as client:
            small = {"prompt": "x", "max_tokens": 4, "temperature": 0}
            assert httpx.post(url + "/v1/completions", json=small, timeout=30).status_code == 200

            streams = [Stream(url) for _ in range(STREAMS)]
            for s in streams:
                threading.Thread(target=s.run, daemon=True).start()
            deadline = time.monotonic() + 30
            while not all(s.chunks > 1 for s in streams):
                assert time.monotonic() < deadline, [s.error for s in streams]
                time.sleep(0.02)

            before = client.status()
            assert before.running == STREAMS, before
            sidecars[0].send_signal(signal.SIGKILL)
            sidecars[0].wait(5)
            killed = time.monotonic()

            # New requests: 503 with Retry-After, each within a second of being sent.
            refusals = []
            while time.monotonic() - killed < 1:
                sent = time.monotonic()
                r = httpx.post(url + "/v1/completions", json=small, timeout=30)
                refusals.append((r.status_code, time.monotonic() - sent, r.headers))
                assert r.json()["error"]["code"] == "admission_unavailable", r.text
            assert all(code == 503 for code, _, _ in refusals), refusals
            assert max(took for _, took, _ in refusals) < 1.0, refusals
            assert all(headers.get("retry-after") == "1" for _, _, headers in refusals)
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503, health.text
            assert address in health.json()["error"]["message"]
            # Drained, not dead: the liveness probe's endpoint answers while the loop runs.
            assert httpx.get(url + "/health/live", timeout=5).status_code == 200
            running_at_loss = sum(not s.done.is_set() for s in streams)
            assert running_at_loss > 0  # the load outlived the kill

            sidecars.append(start_sidecar(address, pool_file, sidecar_log))
            restarted = time.monotonic()
            while httpx.get(url + "/health", timeout=5).status_code != 200:
                assert time.monotonic() - restarted < 10, "the engine never reconnected"
                time.sleep(0.05)
            # The new ledger holds what runs on the engine, each request once.
            deadline = time.monotonic() + 5
            while (status := client.status()).running != engine_running(url):
                assert time.monotonic() < deadline, (status, engine_running(url))
                time.sleep(0.05)
            assert 0 < status.running <= STREAMS, status
            # The same requests with the same reservations, each once (they are alike).
            assert status.reserved * before.running == before.reserved * status.running
            assert httpx.post(url + "/v1/completions", json=small, timeout=30).status_code == 200

            for s in streams:
                assert streams_to_the_end(s), f"a running request stopped streaming: {s}"
            assert [(s.finish, s.completion_tokens, s.error) for s in streams] == [
                ("length", STREAM_TOKENS, "")
            ] * STREAMS
            settled_status(client)
            shown = subprocess.run(
                [sys.executable, "-m", "kvbank.cli", "status", address],
                capture_output=True, text=True, timeout=60, env=ENV, cwd=REPO,
            )  # fmt: skip
            assert "outstanding 0" in shown.stdout, shown.stdout + shown.stderr
    finally:
        for proc in sidecars:
            stop(proc)
    log = serve_log.read_text()
    lost = [line for line in log.splitlines() if "does not answer" in line]
    assert len(lost) == 1 and " ERROR " in lost[0] and address in lost[0], log
    assert "UNAVAILABLE" in lost[0]
    assert sum("answers again" in line for line in log.splitlines()) == 1, log
    assert "Traceback" not in log, log


def test_a_sidecar_started_for_another_pool_is_refused_at_start_up(
    builtin_model_dir: Path, pool_file: Path, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"
    sidecar = start_sidecar(address, pool_file, tmp_path / "sidecar.log")
    try:
        argv = serve_argv(builtin_model_dir, free_port(), "--pages", "64", "--sidecar", address)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=ENV, cwd=REPO)
    finally:
        stop(sidecar)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and "Uvicorn running" not in done.stderr
    assert lines[-1].startswith("kvbank serve: the sidecar at " + address), done.stderr
    assert "pool of 64 pages" in lines[-1] and f"started for {POOL_PAGES}" in lines[-1]
    assert "--pool FILE" in lines[-1]


def test_a_flag_that_contradicts_the_pool_is_refused_naming_both(
    builtin_model_dir: Path, pool_file: Path
) -> None:
    argv = serve_argv(builtin_model_dir, free_port(), "--pool", str(pool_file), "--pages", "300")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=ENV, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"kvbank serve: --pages 300 conflicts with --pool {pool_file}, whose spec.kv.pages gives "
        f"{POOL_PAGES}; drop --pages (the pool settles it), or change the manifest"
    )


def test_serve_pool_takes_the_pool_limits_and_policy(pool_file: Path) -> None:
    import argparse

    from kvbank.engine.serve.flags import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = options_from_args(parser.parse_args(["--pool", str(pool_file)]))
    assert (options.pages, options.page_size, options.max_seq_len, options.max_tokens) == (
        POOL_PAGES,
        16,
        2048,
        1900,
    )
    assert (options.policy, options.kv_label, options.pool) == ("peak+backfill", "main",
                                                                 str(pool_file))  # fmt: skip
    # A flag that says what the pool says is no conflict.
    same = options_from_args(parser.parse_args(["--pool", str(pool_file), "--page-size", "16"]))
    assert same.page_size == 16
