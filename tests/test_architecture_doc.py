"""docs/architecture.md names only files and folders that exist: a newcomer who follows it never
hits a path that moved."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# A path in backticks: folders and files under the repository's top-level names.
TOP = ("kvbank", "engine", "sidecar", "operator", "proto", "charts", "docs", "tests", "examples")
PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


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
