"""`kvbank serve` refuses option combinations that would not do what they say, before loading
anything."""

import argparse

import pytest

from kvbank import cli
from kvbank.engine.serve.flags import options_from_args


def parse(*argv: str):
    argv = ("serve", *argv)
    return cli.build_parser(list(argv)).parse_args(list(argv))


@pytest.mark.parametrize("policy", ["banker", "peak", "peak+backfill", "banker+backfill"])
def test_a_sidecar_serves_every_policy_whose_ledger_it_runs(policy: str) -> None:
    options = options_from_args(parse("--sidecar", "127.0.0.1:50051", "--policy", policy))
    assert (options.policy, options.sidecar) == (policy, "127.0.0.1:50051")


def test_a_sidecar_refuses_a_policy_that_keeps_its_own_books() -> None:
    with pytest.raises(ValueError, match="--policy preempt keeps its own books in-process"):
        options_from_args(parse("--sidecar", "127.0.0.1:50051", "--policy", "preempt"))


def test_every_ledger_mode_is_a_policy_of_the_engine_and_of_the_sidecar() -> None:
    from kvbank.engine.admission.registry import policy_names
    from kvbank.mode import LEDGER_MODE_NAMES, AdmissionMode
    from kvbank.sidecar.server import add_arguments

    assert set(LEDGER_MODE_NAMES) <= set(policy_names())
    assert [AdmissionMode.parse(name).name for name in LEDGER_MODE_NAMES] == [*LEDGER_MODE_NAMES]
    sidecar = argparse.ArgumentParser()
    add_arguments(sidecar)
    for name in LEDGER_MODE_NAMES:
        assert sidecar.parse_args(["--policy", name]).policy == name


def test_an_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of banker, .*peak"):
        options_from_args(parse("--policy", "yolo"))


@pytest.mark.parametrize("policy", ["peak", "peak+backfill", "banker+backfill", "preempt"])
def test_in_process_policies_are_accepted(policy: str) -> None:
    assert options_from_args(parse("--policy", policy)).policy == policy


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-body-bytes", "0"), ("--header-timeout-s", "0"), ("--body-timeout-s", "-1")],
)
def test_http_bounds_must_be_positive(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{flag} must be above 0, got {value}"):
        options_from_args(parse(flag, value))


def test_http_bounds_reach_the_options() -> None:
    options = options_from_args(
        parse("--max-body-bytes", "1000", "--header-timeout-s", "2", "--body-timeout-s", "3")
    )
    assert (options.max_body_bytes, options.header_timeout_s, options.body_timeout_s) == (
        1000,
        2.0,
        3.0,
    )
