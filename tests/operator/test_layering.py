"""The operator's layering, enforced by import-linter: one module imports the Kubernetes
client, only the handlers import kopf, and the builders stay pure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), str(config), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=HERE.parents[1],
        timeout=120,
    )


def test_contracts_are_kept() -> None:
    result = _lint(HERE / "importlinter.ini")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_a_broken_contract_is_reported(tmp_path: Path) -> None:
    """The linter does see the operator's modules: forbidding the client wrapper its own
    library breaks."""
    config = tmp_path / "broken.ini"
    config.write_text(
        "[importlinter]\nroot_packages =\n    kvbank.operator\ninclude_external_packages = True\n"
        "[importlinter:contract:c]\nname = kube without kubernetes\ntype = forbidden\n"
        "source_modules =\n    kvbank.operator.kube\nforbidden_modules =\n    kubernetes\n"
    )
    result = _lint(config)
    assert result.returncode == 1
    assert "kvbank.operator.kube -> kubernetes" in result.stdout
