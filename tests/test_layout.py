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


MAX_MODULE_LINES = 400


def long_modules(root: Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """The hand-written modules under the project's packages with more than `limit` lines
    (protoc's output, marked "DO NOT EDIT" in its first two lines, is not hand-written)."""
    found = []
    for package in ("engine", "sidecar", "kvbank", "operator", "proto"):
        for path in sorted((root / package).rglob("*.py")):
            real = path.resolve()
            if not real.is_relative_to(root.resolve()) or real != path.absolute():
                continue  # kvbank/engine and the like link to a top-level folder
            lines = real.read_text().splitlines()
            if "DO NOT EDIT" not in "".join(lines[:2]) and len(lines) > limit:
                found.append(f"{real.relative_to(root.resolve()).as_posix()}: {len(lines)}")
    return found


def test_no_module_is_over_400_lines() -> None:
    # A module past 400 lines holds two things; split it where they part.
    assert not long_modules(), long_modules()


def test_the_line_check_sees_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "engine" / "short.py").write_text("x = 1\n" * 400)
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "a_pb2.py").write_text("# Generated.  DO NOT EDIT!\n" + "x = 1\n" * 500)
    assert long_modules(tmp_path) == ["engine/long.py: 401"]
