"""`kvbank bench --sidecar` against the embedded ledger, every scenario and every ledger policy.

    python benchmarks/sidecar_equal.py [--scenario scenarios/X.yaml ...] [--policy peak ...]

Starts one `kvbank sidecar` process per ledger policy on loopback, then runs each scenario twice
per policy, embedded and over that sidecar, with `--json`, and prints whether the two outputs are
byte-identical (with the wall time of each). Exit 1 when any pair differs. The runs are on the
virtual clock, so the figures do not depend on the machine's load; only the wall times do.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvbank.mode import LEDGER_MODE_NAMES

ROOT = Path(__file__).resolve().parents[1]
KVBANK = [sys.executable, "-m", "kvbank.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_sidecar(policy: str) -> tuple[subprocess.Popen[bytes], str]:
    address = f"127.0.0.1:{free_port()}"
    argv = [*KVBANK, "sidecar", "--listen", address, "--metrics-port", "-1", "--policy", policy]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host, port = address.split(":")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) == 0:
                return proc, address
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the {policy} sidecar did not listen on {address} within 60 s")


def bench(scenario: Path, policy: str, sidecar: str | None) -> tuple[bytes, float]:
    argv = [*KVBANK, "bench", "--scenario", str(scenario), "--policy", policy, "--json"]
    if sidecar is not None:
        argv += ["--sidecar", sidecar]
    started = time.monotonic()
    out = subprocess.run(argv, capture_output=True, check=True, cwd=ROOT)
    return out.stdout, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", type=Path)
    parser.add_argument("--policy", action="append", choices=LEDGER_MODE_NAMES)
    args = parser.parse_args()
    scenarios = args.scenario or sorted((ROOT / "scenarios").glob("*.yaml"))
    policies = args.policy or list(LEDGER_MODE_NAMES)
    sidecars = {policy: start_sidecar(policy) for policy in policies}
    differ = 0
    try:
        print(f"{'scenario':28} {'policy':16} {'same':5} {'embedded s':>10} {'sidecar s':>10}")
        for scenario in scenarios:
            for policy in policies:
                local, local_s = bench(scenario, policy, None)
                remote, remote_s = bench(scenario, policy, sidecars[policy][1])
                same = local == remote
                differ += not same
                print(
                    f"{scenario.stem:28} {policy:16} {'yes' if same else 'NO':5} "
                    f"{local_s:10.1f} {remote_s:10.1f}",
                    flush=True,
                )
    finally:
        for proc, _ in sidecars.values():
            proc.terminate()
            proc.wait(timeout=10)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
