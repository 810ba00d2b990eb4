"""The `kvbank` console script. Each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command
runs, so `kvbank check` never pays for torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("kvbank.check", "check ModelPool manifests: can the pool hold what they promise?"),
    "serve": ("kvbank.engine.serve.command", "run the engine with its OpenAI-compatible HTTP API"),
    "bench": ("kvbank.engine.bench.cli", "run a benchmark scenario under one or more policies"),
    "sidecar": ("kvbank.sidecar.server", "run the gRPC admission sidecar"),
    "status": ("kvbank.sidecar.status", "print a sidecar's pool, queue and reservations"),
    "operator": ("kvbank.operator.main", "run the Kubernetes operator"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbank", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the command that runs pays for its imports
            importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
