"""docs/architecture.md names only files and folders that exist, and names every module: a newcomer
who follows it never hits a path that moved, and never meets a module it does not mention.

What counts as a module (`modules`): every `*.py` under engine/, sidecar/, kvbank/, operator/ and
proto/, by its real path (kvbank/engine, kvbank/sidecar, kvbank/operator and kvbank/proto are
links to the top-level folders, not more modules), except

- a generated file: one whose first two lines say "DO NOT EDIT" (protoc's proto/*_pb2*.py);
- an `__init__.py` that holds nothing but a docstring, imports and dunder assignments (`__all__`,
  `__version__`): a package's face, with nothing of its own to describe. One that defines
  something (kvbank/vllm/__init__.py's lazy `__getattr__`) is a module.

A module is named when its path appears in backticks (`engine/admission/peak.py`); naming its
folder is not enough. The list is globbed afresh on every run, so a module added without a line
in the doc fails here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# A path in backticks: folders and files under the repository's top-level names.
TOP = ("kvbank", "engine", "sidecar", "operator", "proto", "charts", "docs", "tests", "examples")
PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")
# Where the project's Python modules live.
PACKAGES = ("engine", "sidecar", "kvbank", "operator", "proto")


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


def _says_nothing(node: ast.stmt) -> bool:
    """A docstring, an import or a dunder assignment."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return False
    return all(isinstance(t, ast.Name) and re.fullmatch(r"__\w+__", t.id) for t in targets)


def is_module(path: Path) -> bool:
    text = path.read_text()
    if "DO NOT EDIT" in "".join(text.splitlines(keepends=True)[:2]):
        return False
    if path.name != "__init__.py":
        return True
    return not all(_says_nothing(node) for node in ast.parse(text).body)


def modules(root: Path = ROOT) -> list[str]:
    """Every module under `root` by the rule above, as paths relative to it."""
    root = root.resolve()
    found = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            real = path.resolve()
            if real.is_relative_to(root) and is_module(real):
                found.add(real.relative_to(root).as_posix())
    return sorted(found)


def unnamed(text: str, listed: Iterable[str]) -> list[str]:
    """The modules `text` does not name in backticks."""
    named = set(named_paths(text))
    return [module for module in listed if module not in named]


def test_every_path_the_architecture_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 40  # the doc does name the tree
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, missing


def test_the_check_sees_a_missing_path() -> None:
    assert named_paths("see `engine/nowhere.py` and `kvbank/ledger/`") == [
        "engine/nowhere.py",
        "kvbank/ledger/",
    ]
    assert not (ROOT / "engine/nowhere.py").exists()


def test_every_module_is_named() -> None:
    found = modules()
    assert len(found) > 100  # the rule does find the tree
    assert "kvbank/vllm/scheduler.py" in found and "proto/generate.py" in found
    missing = unnamed(DOC.read_text(), found)
    assert not missing, f"docs/architecture.md names no line for: {missing}"


def test_the_check_sees_a_missing_module() -> None:
    text = "the ledger (`kvbank/ledger/ledger.py`) and the policies (`engine/admission/`)"
    listed = ["kvbank/ledger/ledger.py", "engine/admission/peak.py", "engine/nowhere.py"]
    assert unnamed(text, listed) == ["engine/admission/peak.py", "engine/nowhere.py"]


def test_the_rule_skips_generated_files_and_empty_inits(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": '"""Docstring only."""\nfrom __future__ import annotations\n',
        "engine/kv/__init__.py": '"""A face."""\nfrom x import y\n__all__ = ["y"]\n',
        "engine/kv/cache.py": '"""A module."""\n',
        "kvbank/vllm/__init__.py": '"""Lazy."""\ndef __getattr__(name):\n    return name\n',
        "proto/admission_pb2.py": "# -*- coding: utf-8 -*-\n# Generated.  DO NOT EDIT!\nX = 1\n",
        "proto/generate.py": '"""Regenerate the stubs."""\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "kvbank" / "engine").symlink_to("../engine")  # a link is no second copy
    assert modules(tmp_path) == [
        "engine/kv/cache.py",
        "kvbank/vllm/__init__.py",
        "proto/generate.py",
    ]
