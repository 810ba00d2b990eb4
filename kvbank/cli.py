"""The `kvbank` console script. Each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command
runs, so `kvbank check` never pays for torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbank import __version__

DESCRIPTION = (
    "kvbank: KV-cache admission control for LLM serving. An admitted request never runs out "
    "of KV-cache pages. Run `kvbank COMMAND --help` for a command's flags."
)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("kvbank.check", "check ModelPool manifests: can the pool hold what they promise?"),
    "plan": ("kvbank.plan", "size a pool from a model's config.json and the GPUs it runs on"),
    "serve": ("kvbank.engine.serve.command", "run the engine with its OpenAI-compatible HTTP API"),
    "bench": ("kvbank.engine.bench.cli", "run a benchmark scenario under one or more policies"),
    "sidecar": ("kvbank.sidecar.server", "run the gRPC admission sidecar"),
    "status": ("kvbank.sidecar.status", "print a sidecar's pool, queue and reservations"),
    "operator": ("kvbank.operator.main", "run the Kubernetes operator"),
    "picker": ("kvbank.picker.server", "run the endpoint picker for a Gateway API InferencePool"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except where there is none to show (None, a switch)
    or the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or isinstance(default, bool) or default == argparse.SUPPRESS:
            return text
        if "default" in text or not action.option_strings:
            return text
        if isinstance(default, list | tuple) and not default:
            return text
        return f"{text} (default: %(default)s)"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbank", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvbank {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
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
