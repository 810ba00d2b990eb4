"""`kvbank serve` refuses option combinations that would not do what they say, before loading
anything."""

import pytest

from kvbank import cli
from kvbank.engine.serve import options_from_args


def parse(*argv: str):
    argv = ("serve", *argv)
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_a_sidecar_serves_only_the_banker_policy() -> None:
    with pytest.raises(ValueError, match="Use --policy banker with --sidecar, or drop --sidecar"):
        options_from_args(parse("--sidecar", "127.0.0.1:50051", "--policy", "peak"))
    assert options_from_args(parse("--sidecar", "127.0.0.1:50051")).policy == "banker"


def test_an_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of banker, .*peak"):
        options_from_args(parse("--policy", "yolo"))


@pytest.mark.parametrize("policy", ["peak", "peak+backfill", "banker+backfill", "preempt"])
def test_in_process_policies_are_accepted(policy: str) -> None:
    assert options_from_args(parse("--policy", policy)).policy == policy
