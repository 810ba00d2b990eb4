"""The registry recipe for vLLM pools (containers/vllm.Containerfile) installs the vLLM the tests
run (the Makefile's VLLM_VERSION) on the Python minor the tests run, so the image GPU users
build is the tested one; `make images` takes the CPU build's pins from the Makefile itself."""

from __future__ import annotations

import re
import sys

from e2e_kube import ROOT

CONTAINERFILE = ROOT / "containers" / "vllm.Containerfile"


def makefile_variable(name: str) -> str:
    [value] = re.findall(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return value


def test_the_vllm_containerfile_installs_the_tested_vllm_on_the_tested_python() -> None:
    text = CONTAINERFILE.read_text()
    assert re.findall(r'"vllm==([^"]+)"', text) == [makefile_variable("VLLM_VERSION")]
    [python] = re.findall(r"^FROM docker\.io/library/python:(\d+\.\d+)\.\d+-", text, re.M)
    assert python == f"{sys.version_info.major}.{sys.version_info.minor}"
