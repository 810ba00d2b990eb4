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


def test_bases_are_pinned_and_users_are_not_root() -> None:
    expected_bases = {
        "operator.Containerfile": r"docker\.io/library/python:3\.\d+\.\d+-slim-\w+",
        "engine.Containerfile": (
            r"docker\.io/pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime"
        ),
    }
    for name, pattern in expected_bases.items():
        lines = instructions(name)
        [base] = [line.split()[1] for line in lines if line.startswith("FROM ")]
        assert re.fullmatch(pattern, base), f"{name}: base {base} is not pinned to a version"
        [user] = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert user.split(":")[0] not in {"0", "root"}, name


def test_each_image_installs_the_extras_its_commands_need() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    defined = set(extras["optional-dependencies"])
    wanted = {"operator.Containerfile": {"operator"}, "engine.Containerfile": {"engine", "gpu"}}
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
