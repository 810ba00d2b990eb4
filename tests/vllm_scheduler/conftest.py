"""These tests run vLLM's real scheduler, so they run in vLLM's own environment:
`make test-vllm` (part of `make test`) runs them with .venv-vllm's Python. In an environment
without vllm they are not collected."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU: vLLM's CPU platform
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `kvbank sidecar` on loopback, peak+backfill, with a token and debug checks."""
    token = tmp_path_factory.mktemp("sidecar") / "token"
    token.write_text("vllm-property\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", "127.0.0.1:0",
         "--metrics-port", "-1", "--policy", "peak+backfill", "--token-file", str(token),
         "--debug"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"serving on [\d.]+:(\d+)", line)
        assert match, f"the sidecar did not start: {line!r}"
        yield f"127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
