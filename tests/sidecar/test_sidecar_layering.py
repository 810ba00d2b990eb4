"""Only the client wrapper talks to gRPC peers: no other module of the package opens a channel
or builds a stub, so the deadline, retry and UNAVAILABLE policies cannot be bypassed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPENS_A_PEER = re.compile(r"\b(insecure_channel|secure_channel|\w+Stub)\(")
THE_CLIENT = ROOT / "sidecar" / "client.py"


def test_only_the_client_module_opens_channels_or_stubs() -> None:
    sources = [
        path
        for folder in ("kvbank", "engine", "sidecar", "operator")
        for path in (ROOT / folder).rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")) and not path.is_symlink()
    ]
    assert THE_CLIENT in sources
    offenders = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sources
        if path != THE_CLIENT
        for match in OPENS_A_PEER.finditer(path.read_text())
    ]
    assert offenders == []
