"""Helpers that start real sidecars on loopback: in a thread (fast, for contract tests) or as a
`kvbank sidecar` process (for faults: SIGKILL, SIGTERM, restarts)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbank.sidecar import server
from kvbank.sidecar.client import SidecarClient

READY = re.compile(r"serving on (?:[\d.]+:(\d+)|unix://\S+), metrics (?:[\d.]+:(\d+)|off)")
ROOT = Path(__file__).resolve().parents[2]


def make_config(**changes: Any) -> server.Config:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    config = server.config_from_args(parser.parse_args(["--listen", "127.0.0.1:0"]))
    return replace(config, metrics_port=-1, debug=True, **changes)


class ThreadSidecar(threading.Thread):
    """A sidecar on its own event loop in a daemon thread."""

    def __init__(self, config: server.Config) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.ready = threading.Event()
        self.port = 0
        self.failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self.state: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            await server.serve(self.config, self._stop_event, self._on_ready)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by start()
            self.failure = exc
            self.ready.set()

    def _on_ready(self, port: int) -> None:
        self.port = port
        self.ready.set()

    def start_and_wait(self) -> ThreadSidecar:
        self.start()
        assert self.ready.wait(10), "the sidecar did not start within 10 s"
        if self.failure:
            raise self.failure
        return self

    def shutdown(self) -> None:
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self.join(10)


def spawn_sidecar(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int, int | None]:
    """Start `kvbank sidecar` on an ephemeral loopback port (or the `--listen` in `args`);
    returns (process, port, metrics); the port is 0 on a Unix socket."""
    listen = [] if "--listen" in args else ["--listen", "127.0.0.1:0"]
    cmd = [sys.executable, "-m", "kvbank.cli", "sidecar", *listen, *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = READY.search(line)
    if not match:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"the sidecar did not start: {line!r} {err}")
    metrics = int(match.group(2)) if match.group(2) else None
    return proc, int(match.group(1) or 0), metrics


def bench_both_ways(
    bench_args: list[str], sidecar_args: list[str]
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], Any]:
    """`kvbank bench *bench_args` with the embedded ledger, then again over a real sidecar
    started with `sidecar_args`; returns both runs and the sidecar's status reply after them."""
    bench = [sys.executable, "-m", "kvbank.cli", "bench", *bench_args]
    proc, port, _ = spawn_sidecar(*sidecar_args)
    try:
        local = subprocess.run(bench, capture_output=True, text=True, timeout=60, cwd=ROOT)
        remote = subprocess.run(
            [*bench, "--sidecar", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=100,
            cwd=ROOT,
        )
        with SidecarClient(f"127.0.0.1:{port}") as client:
            served = client.status_reply()
    finally:
        stop_process(proc)
    return local, remote, served


def stop_process(proc: subprocess.Popen[str], timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return proc.returncode
