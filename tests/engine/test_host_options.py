"""The host tier's size where a user sets it: `kvbank serve --host-pages` and ModelPool
`spec.kv.hostPages`."""

from __future__ import annotations

import pytest

from kvbank import cli
from kvbank.engine.serve.flags import options_from_args
from kvbank.modelpool import SpecError, parse_modelpool
from tests.core.test_holdability import make_spec


def parse(*argv: str):  # type: ignore[no-untyped-def]
    argv = ("serve", *argv)
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_serve_takes_a_host_tier_size() -> None:
    assert options_from_args(parse("--host-pages", "512")).host_pages == 512
    assert options_from_args(parse()).host_pages == 0


def test_serve_refuses_a_negative_host_tier() -> None:
    with pytest.raises(ValueError, match="--host-pages must be at least 0 .*got -3"):
        options_from_args(parse("--host-pages", "-3"))


def test_a_modelpool_sets_its_host_tier_under_kv() -> None:
    assert parse_modelpool(make_spec(**{"kv.hostPages": 4096})).kv.host_pages == 4096
    assert parse_modelpool(make_spec()).kv.host_pages == 0


@pytest.mark.parametrize(("value", "message"), [(-1, "got -1"), ("many", "got 'many'")])
def test_a_bad_host_tier_names_the_field(value: object, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_modelpool(make_spec(**{"kv.hostPages": value}))
    assert [e.path for e in err.value.errors] == ["spec.kv.hostPages"]
    assert message in str(err.value)
