"""An engine as a real process whose ledger is a sidecar, for the engine-death test: it prints
`running` once requests are admitted, then keeps stepping until it is killed."""

from __future__ import annotations

import sys

from engine_run import run, scenario

from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient


def main() -> int:
    address, lease_s = sys.argv[1], float(sys.argv[2])
    sc = scenario("shared-prefix", 400, 32)
    backend = SidecarBackend(SidecarClient(address), sc.pages, engine_id="doomed", lease_s=lease_s)

    def announce(step: int) -> None:
        if step == 200:
            print("running", flush=True)

    run(sc, backend, on_step=announce)
    return 0


if __name__ == "__main__":
    sys.exit(main())
