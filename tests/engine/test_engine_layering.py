"""The engine's layering, enforced by import-linter (tests/engine/importlinter.ini): the page
manager and the prefix index know nothing of admission, admission knows neither the scheduler
nor the model, the model knows nothing of admission, and the sidecar nothing of the engine. The
core below them all is checked by what importing it loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), str(config), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_contracts_are_kept() -> None:
    result = _lint(HERE / "importlinter.ini")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


def test_a_broken_contract_is_reported(tmp_path: Path) -> None:
    """The linter does see the engine's modules, indirect imports included: the cache reaches
    the page pool through the request, and forbidding the pool to it breaks."""
    config = tmp_path / "broken.ini"
    config.write_text(
        "[importlinter]\nroot_packages =\n    kvbank.engine\ninclude_external_packages = True\n"
        "[importlinter:contract:c]\nname = cache without the request\ntype = forbidden\n"
        "source_modules =\n    kvbank.engine.kv.cache\nforbidden_modules =\n"
        "    kvbank.engine.request\n"
    )
    result = _lint(config)
    assert result.returncode == 1
    assert "kvbank.engine.kv.cache -> kvbank.engine.request" in result.stdout


def test_the_core_loads_nothing_built_on_it() -> None:
    code = (
        "import sys\n"
        "import kvbank.capacity, kvbank.check, kvbank.ledger, kvbank.mode, kvbank.modelpool\n"
        "above = ('kvbank.engine', 'kvbank.sidecar', 'kvbank.operator', 'torch')\n"
        "print(sorted(m for m in sys.modules if m.startswith(above)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
