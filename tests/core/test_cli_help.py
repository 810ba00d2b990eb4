"""`kvbank --help`, `--version` and every command's help: each flag says what it does, and its
default where it has one."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbank import __version__
from kvbank.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]


def kvbank(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser([name])
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_the_top_level_help_is_whole_sentences_and_there_is_a_version() -> None:
    out = kvbank("--help")
    assert out.returncode == 0
    description = out.stdout.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
    assert "which\nexposes" not in out.stdout
    version = kvbank("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kvbank {__version__}"


def shown_default(action: argparse.Action) -> bool:
    return (
        bool(action.option_strings)
        and isinstance(action.default, int | float | str)
        and not isinstance(action.default, bool)
        and action.default != argparse.SUPPRESS
    )


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(name: str) -> None:
    parser = command_parser(name)
    formatter = parser._get_formatter()
    for action in parser._actions:
        flag = f"kvbank {name} {action.option_strings or action.dest}"
        assert action.help, f"{flag}: no help"
        if shown_default(action):
            assert "default" in formatter._get_help_string(action), f"{flag}: default not shown"
    parser.format_help()  # every help string formats (a stray % would raise)


@pytest.mark.parametrize(
    ("name", "flag", "default"),
    [
        ("serve", "--port", "8000"),
        ("status", "--deadline-s", "2.0"),
        ("sidecar", "--max-message-bytes", "1048576"),
        ("operator", "--webhook-port", "9443"),
        ("operator", "--gpu-resource", "nvidia.com/gpu"),
    ],
)
def test_named_flags_show_their_defaults(name: str, flag: str, default: str) -> None:
    text = " ".join(command_parser(name).format_help().split())
    options = text.rsplit(f"{flag} {flag.lstrip('-').upper().replace('-', '_')} ", 1)[1]
    assert f"(default: {default})" in options.split(" --", 1)[0], options[:300]


def test_the_operator_without_a_cluster_says_what_to_give(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "KVBANK_"))}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    out = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "operator"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot reach a Kubernetes API" in out.stderr
    assert "give --kubeconfig PATH" in out.stderr
    assert "Traceback" not in out.stderr
