"""`kvbank serve`'s class flags: their defaults, a bad value refused by the flag's name before
anything loads, and the settings carried to every tensor-parallel rank (the launcher's JSON
options, and each request's asked class in rank 0's journal)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from kvbank import cli
from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.serve.flags import options_from_args
from kvbank.engine.serve.stack import ServeOptions
from kvbank.engine.tp.launch import _journal_requests, rank_command
from kvbank.modelpool import KvSlot
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim
from tests.http.process import REPO


def parse(*argv: str):  # type: ignore[no-untyped-def]
    argv = ("serve", *argv)
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_the_defaults_keep_every_request_strict() -> None:
    options = options_from_args(parse())
    assert options.classes == ClassPolicy(ServiceClass.STRICT, 2, Victim.NEWEST, Estimate.LEARNED)


def test_the_flags_build_the_engines_class_policy() -> None:
    options = options_from_args(
        parse("--default-class", "best-effort", "--max-preemptions", "0", "--victim", "cheapest",
              "--estimate", "ratio")
    )  # fmt: skip
    assert options.classes == ClassPolicy(
        ServiceClass.BEST_EFFORT, 0, Victim.CHEAPEST, Estimate.RATIO
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--default-class", "flex"), "--default-class 'flex' is not a service class; choose "
         "strict or best-effort"),
        (("--max-preemptions", "-1"), "--max-preemptions must be at least 0"),
        (("--victim", "oldest"), "--victim 'oldest' is not a victim rule; choose newest or "
         "cheapest"),
        (("--estimate", "oracle"), "--estimate 'oracle' is not an output estimate; choose "
         "learned or ratio"),
    ],
)  # fmt: skip
def test_a_bad_class_flag_is_refused_by_name(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options_from_args(parse(*argv))


def test_kvbank_serve_exits_2_naming_the_flag_before_loading_anything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "serve", "--victim", "random", "--port", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert "kvbank serve: --victim 'random' is not a victim rule" in done.stderr


def test_help_shows_each_default() -> None:
    wide = {**os.environ, "COLUMNS": "1000"}  # argparse would break "best-effort" at its hyphen
    argv = [sys.executable, "-m", "kvbank.cli", "serve", "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=wide)
    text = " ".join(done.stdout.split())
    assert "best-effort (may be preempted on a shortage); default: strict" in text
    assert "runs to completion (default: 2)" in text
    assert "after host reload); default: newest" in text
    assert "a decaying share of its budget); default: learned" in text


def test_every_rank_gets_the_class_settings() -> None:
    options = ServeOptions(
        default_class="best-effort", max_preemptions=5, victim="cheapest", estimate="ratio"
    )
    command = rank_command(1, 2, "127.0.0.1:1", options, "127.0.0.1", 8000, 5.0)
    sent = ServeOptions(**json.loads(command[command.index("--options") + 1]))
    assert sent.classes == ClassPolicy(ServiceClass.BEST_EFFORT, 5, Victim.CHEAPEST, Estimate.RATIO)


def _engine(default: ServiceClass) -> Engine:
    model = CapacityModel({"kv": KvSlot(prompt=1, output=1)}, 4, 64, 8)
    return Engine(EngineConfig(model, 32, classes=ClassPolicy(default)), VirtualRunner())


@pytest.mark.parametrize("default", list(ServiceClass))
def test_rank_0s_journal_carries_each_requests_asked_class(default: ServiceClass) -> None:
    # Followers add what the journal says under their own (same) class settings, so they must
    # get what was asked, not what rank 0 granted: both derive the same grant from it.
    leader = _engine(default)
    journal: list[object] = []
    _journal_requests(leader, journal)
    asked = {"a": None, "b": ServiceClass.STRICT, "c": ServiceClass.BEST_EFFORT}
    granted = {rid: leader.add_request(rid, [1, 2, 3], 4, service_class=cls).service_class
               for rid, cls in asked.items()}  # fmt: skip
    sent = pickle.loads(pickle.dumps(journal))  # as the plan travels to the followers
    assert {entry.rid: entry.service_class for entry in sent} == asked
    assert granted == {"a": default, "b": ServiceClass.STRICT, "c": ServiceClass.BEST_EFFORT}
