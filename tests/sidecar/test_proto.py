"""The committed stubs match the contract, and an installed package imports them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvbank.proto.generate import PROTOS, generate

ROOT = Path(__file__).resolve().parents[2]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    written = generate(tmp_path, include_root=ROOT)
    assert len(written) == 3 * len(PROTOS)
    stale = [p.name for p in written if p.read_bytes() != (ROOT / "proto" / p.name).read_bytes()]
    assert not stale, f"stale generated code {stale}: run `python -m kvbank.proto.generate`"


def test_generated_code_imports_as_kvbank_proto() -> None:
    text = (ROOT / "proto" / "admission_pb2_grpc.py").read_text()
    assert "from kvbank.proto import admission_pb2" in text


@pytest.mark.slow
def test_a_built_wheel_carries_working_stubs(tmp_path: Path) -> None:
    build = subprocess.run(
        [*PIP_WHEEL, "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("kvbank-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "admission.proto",
        "admission_pb2.py",
        "admission_pb2.pyi",
        "admission_pb2_grpc.py",
    ):
        assert f"kvbank/proto/{name}" in names
    for module in ("server", "service", "state", "client", "backend", "follower", "status"):
        assert f"kvbank/sidecar/{module}.py" in names
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import kvbank.proto.admission_pb2_grpc as g, kvbank.proto.admission_pb2 as p;"
        "print(g.__file__); print(p.Decision(seq=3).seq)"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); {code}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        str(tmp_path / "site/kvbank/proto/admission_pb2_grpc.py"),
        "3",
    ]
