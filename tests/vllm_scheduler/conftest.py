"""These tests run vLLM's real scheduler, so they run in vLLM's own environment:
`make test-vllm` (part of `make test`) runs them with .venv-vllm's Python. In an environment
without vllm they are not collected."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU: vLLM's CPU platform
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
