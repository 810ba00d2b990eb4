"""What the core dependencies carry: a virtual environment with `pip install .` and no extras
runs the sidecar, `kvbank check` and the ledger (whose peak-fit timeline needs numpy). An import
that only an extra installs fails here, not in a user's sidecar container."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("modelpool-*.yaml"))


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # pip's own cache serves what earlier runs downloaded; the core dependencies come with it.
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    assert install.returncode == 0, install.stderr[-4000:]
    return venv


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: only what the virtual environment installed is importable."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=venv.parent,  # not the repository
        env=clean_env(),
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_core_install_runs_the_sidecar_check_and_the_ledger(core_venv: Path) -> None:
    extras = run(core_venv, "python", "-c", "import torch")
    assert extras.returncode != 0, "the core install pulled in an extra (torch)"
    helped = run(core_venv, "kvbank", "sidecar", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--policy" in helped.stdout
    checked = run(core_venv, "kvbank", "check", *map(str, EXAMPLES))
    assert checked.returncode == 1, checked.stderr  # one example is unholdable on purpose
    assert checked.stdout.count("OK ") == 1 and checked.stdout.count("FAIL ") == 1
    code = (
        "import kvbank.sidecar.server\n"
        "from kvbank.ledger import Ledger, PeakPolicy\n"
        "ledger = Ledger(64, policy=PeakPolicy(16))\n"
        "assert ledger.submit('r', 8) is None and ledger.try_admit('r').rid == 'r'\n"
        "print('ok')"
    )
    imported = run(core_venv, "python", "-c", code)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "ok"
