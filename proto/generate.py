"""Regenerate the Python stubs of the admission contract.

    python -m kvbank.proto.generate            # rewrite proto/*_pb2*.py(i) in place

The include root is the folder that holds `kvbank/`, so the proto's path is
`kvbank/proto/admission.proto` and the generated code imports `kvbank.proto.admission_pb2`,
which is how it is installed. The stubs are committed, so `pip install .` needs no code
generation; tests/sidecar/test_proto.py fails when they are stale against the `.proto`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTOS = ("admission.proto",)
HERE = Path(__file__).resolve().parent  # proto/ (kvbank/proto is a symlink to it)


def generate(out_root: Path, include_root: Path | None = None) -> list[Path]:
    """Write the stubs under `out_root/kvbank/proto/`; returns the files written."""
    from grpc_tools import protoc  # a build/dev tool: only generation needs it

    root = include_root or Path(__file__).parents[1].parent  # the folder holding kvbank/
    (out_root / "kvbank" / "proto").mkdir(parents=True, exist_ok=True)
    written = []
    for name in PROTOS:
        args = [
            "protoc",
            f"-I{root}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--pyi_out={out_root}",
            f"kvbank/proto/{name}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on kvbank/proto/{name}: {' '.join(args)}")
        stem = name.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_root / "kvbank" / "proto" / f"{stem}{suffix}")
    return written


def main() -> int:
    for path in generate(HERE.parent / "build" / "proto-gen"):
        target = HERE / path.name
        target.write_bytes(path.read_bytes())
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
