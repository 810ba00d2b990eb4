"""`kvbank check` as a user runs it: the installed console script, real files, exit codes."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def kvbank(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvbank", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "kvbank.cli"]
    return subprocess.run(
        [*cmd, *args], input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_the_holdable_example_passes() -> None:
    out = kvbank("check", str(EXAMPLES / "modelpool-llama-8b.yaml"))
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
    assert "worst-case request 513 pages" in out.stdout
    assert "holds 38 worst-case requests at once" in out.stdout


def test_the_unholdable_example_names_the_field_and_the_number() -> None:
    out = kvbank("check", str(EXAMPLES / "modelpool-unholdable.yaml"))
    assert out.returncode == 1
    assert "Raise kv.pages to at least 514" in out.stdout
    assert "lower limits.maxSeqLen to at most 6383" in out.stdout


def test_multi_document_files_check_every_pool(tmp_path: Path) -> None:
    both = (EXAMPLES / "modelpool-llama-8b.yaml").read_text() + "\n---\n"
    both += (EXAMPLES / "modelpool-unholdable.yaml").read_text()
    path = tmp_path / "both.yaml"
    path.write_text(both)
    out = kvbank("check", str(path))
    assert out.returncode == 1
    assert out.stdout.count("OK ") == 1 and out.stdout.count("FAIL ") == 1


def test_yaml_1_2_floats_are_numbers(tmp_path: Path) -> None:
    # kubectl reads 8.03e9 as a number; so must kvbank check (PyYAML alone reads a string)
    text = (EXAMPLES / "modelpool-llama-8b.yaml").read_text()
    assert "8.03e9" in text
    assert kvbank("check", "-", stdin=text).returncode == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a: [unclosed", "not valid YAML"),
        ("apiVersion: v1\nkind: Pod\n", "kind 'Pod' is not ModelPool"),
        (
            "apiVersion: kvbank.dev/v1alpha1\nkind: ModelPool\nmetadata: {name: x}\nspec: {}\n",
            "spec.model: is missing",
        ),
        ("", "no YAML documents"),
    ],
)
def test_bad_files_exit_2_with_a_clear_message(tmp_path: Path, content: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    out = kvbank("check", str(path))
    assert out.returncode == 2
    assert message in out.stderr


def test_a_missing_file(tmp_path: Path) -> None:
    out = kvbank("check", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_the_pod_fields_are_checked_as_the_webhook_checks_them(tmp_path: Path) -> None:
    text = (EXAMPLES / "modelpool-llama-8b.yaml").read_text()
    bad = text.replace("shmSize: 16Gi", "shmSize: 16GB")
    assert bad != text
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    out = kvbank("check", str(path))
    assert out.returncode == 2
    assert "spec.template.shmSize: must be a Kubernetes quantity" in out.stderr
