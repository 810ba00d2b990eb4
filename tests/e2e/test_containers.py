"""What can be checked of the Containerfiles without a container runtime: pinned bases, a
non-root user, the extras each image installs, and that the operator image's extras are enough
for `kvbank operator` (it must not need torch)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from e2e_kube import ROOT

CONTAINERS = ROOT / "containers"
# Installed by the engine image only; the operator image must run without every one of them.
ENGINE_ONLY = ("torch", "numpy", "fastapi", "uvicorn", "safetensors", "tokenizers", "jinja2")


def instructions(name: str) -> list[str]:
    text = (CONTAINERS / name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


IMAGES = ("operator.Containerfile", "engine.Containerfile", "vllm.Containerfile")


def test_bases_are_pinned_to_the_tested_python_and_users_are_not_root() -> None:
    """Python's minor version is the one the tests run and mypy checks (pyproject.toml)."""
    tested = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["python_version"]
    assert tested == f"{sys.version_info.major}.{sys.version_info.minor}"
    pattern = rf"docker\.io/library/python:{re.escape(tested)}\.\d+-slim-\w+"
    for name in IMAGES:
        lines = instructions(name)
        [base] = [line.split()[1] for line in lines if line.startswith("FROM ")]
        assert re.fullmatch(pattern, base), f"{name}: base {base} is not Python {tested}.N"
        [user] = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert user.split(":")[0] == "10001", name  # the pods' runAsUser (render.security)


def test_torch_and_vllm_are_the_tested_versions() -> None:
    import importlib.metadata

    torch = importlib.metadata.version("torch").split("+")[0]
    [engine] = [line for line in instructions("engine.Containerfile") if "pip install" in line]
    assert f'"torch=={torch}"' in engine, f"the engine image must pin the tested torch {torch}"
    makefile = (ROOT / "Makefile").read_text()
    [vllm] = re.findall(r"^VLLM_VERSION := (\S+)$", makefile, re.MULTILINE)
    [install] = [line for line in instructions("vllm.Containerfile") if "pip install" in line]
    assert f'"vllm=={vllm}"' in install, f"the vLLM image must pin make vllm-venv's {vllm}"


def test_each_image_installs_the_extras_its_commands_need() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    defined = set(extras["optional-dependencies"])
    # The engine image also runs `kvbank picker` (the operator's picker Deployment uses it).
    wanted = {
        "operator.Containerfile": {"operator"},
        "engine.Containerfile": {"engine", "gpu", "picker"},
    }
    for name, groups in wanted.items():
        [install] = [line for line in instructions(name) if "pip install" in line]
        found = re.search(r'"\.\[([\w,]+)\]"', install)
        assert found, f"{name}: no pip install of the project with extras"
        assert set(found.group(1).split(",")) == groups <= defined, name


def test_the_operator_runs_without_the_engine_extras() -> None:
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ENGINE_ONLY)
    code = (
        f"import sys; {blocked}\n"
        "from kvbank.cli import main\n"
        "import kvbank.operator.handlers, kvbank.operator.kube, kvbank.operator.live\n"
        "sys.exit(main(['operator', '--help']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "--webhook-extra-san" in out.stdout
