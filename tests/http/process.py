"""`kvbank serve` as its own process on a free loopback port: the server a user runs, flags and
all, for tests of what a hostile or careless client can do to it."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.http.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
# A small pool, as tests/http/conftest.py serves in-process.
SMALL_FLAGS = ("--pages", "64", "--max-seq-len", "2048", "--max-tokens", "2000",
               "--max-batch-tokens", "256")  # fmt: skip


@dataclass
class ServeProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve_process(
    model_dir: Path, log_dir: Path, *flags: str, soft_open_files: int | None = None
) -> Iterator[ServeProcess]:
    """`kvbank serve` with `flags`; `soft_open_files` starts it under that soft limit."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model_dir),
            "--port", str(port), *SMALL_FLAGS, *flags]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   preexec_fn=_soft_limit(soft_open_files))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise AssertionError(f"kvbank serve exited {process.returncode}:\n"
                                     f"{log.read_text(errors='replace')}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"kvbank serve never answered:\n{log.read_text()}"
            time.sleep(0.2)
        yield ServeProcess(url, port, process, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _soft_limit(open_files: int | None) -> Callable[[], None] | None:
    if open_files is None:
        return None

    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))

    return lower
