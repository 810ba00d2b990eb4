"""The package layout promises: no top-level folder shadows a standard module."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bare_operator_import_is_the_standard_library_from_the_repository_root() -> None:
    code = "import operator, kvbank.operator; print(operator.itemgetter(1)([0, 7]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "7"


def test_top_level_folders_are_not_regular_packages() -> None:
    for folder in ("engine", "sidecar", "operator", "proto"):
        assert not (ROOT / folder / "__init__.py").exists(), folder
