"""The engine's layering, enforced by import-linter (tests/engine/importlinter.ini): the page
manager and the prefix index know nothing of admission, admission knows neither the scheduler
nor the model, the model knows nothing of admission, and the sidecar nothing of the engine. The
core below them all is checked by what importing it loads."""

from __future__ import annotations

import ast
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


# The core's modules: everything under kvbank/ but the links to the parts built on it, the
# command line that dispatches to them, the vLLM plug-in (which may reach a sidecar) and the
# endpoint picker's service (which reads requests as the engine does; its rule is core).
ABOVE = ("kvbank.engine", "kvbank.sidecar", "kvbank.operator")
CORE_SKIP = {"engine", "sidecar", "operator", "proto", "vllm", "picker", "cli.py"}
# What the picker's service may use of the engine: how the engine reads and tokenizes a request.
PICKER_READS = (
    "kvbank.engine.model.tokenizer",
    "kvbank.engine.model.builtin",
    "kvbank.engine.serve.http.errors",
    "kvbank.engine.serve.http.schema",
    "kvbank.engine.serve.http.tiers",
)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, at the top or inside a function (a lazy import counts)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def reaching_above(paths: list[Path], above: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports {name}"
        for path in paths
        for line, name in imports_of(path)
        if name.startswith(above)
    ]


def core_modules() -> list[Path]:
    kvbank = ROOT / "kvbank"
    return [
        path
        for path in sorted(kvbank.rglob("*.py"))
        if path.relative_to(kvbank).parts[0] not in CORE_SKIP
    ]


def test_the_core_imports_nothing_built_on_it_not_even_lazily() -> None:
    modules = core_modules()
    assert ROOT / "kvbank" / "ledger" / "client.py" in modules
    assert not reaching_above(modules, ABOVE)


def test_the_picker_rule_is_core_and_its_service_reads_requests_as_the_engine_does() -> None:
    picker = sorted((ROOT / "kvbank" / "picker").glob("*.py"))
    assert ROOT / "kvbank" / "picker" / "rule.py" in picker
    assert not reaching_above([ROOT / "kvbank" / "picker" / "rule.py"], ABOVE)
    reached = reaching_above(picker, ("kvbank.engine", "kvbank.operator"))
    assert reached  # the service does read requests with the engine's parts
    assert [r for r in reached if not r.endswith(PICKER_READS)] == []


def test_the_vllm_plug_in_imports_the_ledger_client_not_the_engine() -> None:
    modules = sorted((ROOT / "kvbank" / "vllm").glob("*.py"))
    assert not reaching_above(modules, ("kvbank.engine", "kvbank.operator"))


def test_a_lazy_import_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from kvbank.engine.engine import Engine\n    return Engine\n")
    assert reaching_above([module], ABOVE) == [f"{module}:2 imports kvbank.engine.engine"]
