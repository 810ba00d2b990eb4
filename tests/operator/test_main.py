"""`kvbank operator`: flags and their environment variables, and what `run` hands to kopf."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kvbank import cli
from kvbank.operator import main as operator_main
from kvbank.operator.config import OperatorConfig, add_arguments


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    return parser.parse_args(list(flags))


class TestConfig:
    def test_defaults(self) -> None:
        config = OperatorConfig.from_args(_parse())
        assert (config.webhook_listen, config.webhook_port) == ("0.0.0.0", 9443)
        assert config.tls.mode == "self-signed"
        assert config.tls.webhook_configuration == "kvbank-operator"
        assert config.tls.names[:3] == (
            "kvbank-webhook",
            "kvbank-webhook.kvbank-system",
            "kvbank-webhook.kvbank-system.svc",
        )
        assert config.namespaces == ()
        assert config.render.termination_grace_seconds == 600

    def test_environment_sets_what_flags_do(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KVBANK_WEBHOOK_PORT", "8443")
        monkeypatch.setenv("KVBANK_CERT_MODE", "none")
        monkeypatch.setenv("KVBANK_WATCH_NAMESPACES", "team-a,team-b")
        monkeypatch.setenv("POD_NAMESPACE", "ops")
        monkeypatch.setenv("KVBANK_IMAGE", "registry.example/kvbank:9")
        parser = argparse.ArgumentParser()
        add_arguments(parser)  # defaults are read when the parser is built
        config = OperatorConfig.from_args(parser.parse_args(["--webhook-port", "7443"]))
        assert config.webhook_port == 7443  # a flag beats its variable
        assert config.tls.mode == "none" and config.tls.namespace == "ops"
        assert config.namespaces == ("team-a", "team-b")
        assert config.render.image == "registry.example/kvbank:9"

    def test_the_sidecar_token_reaches_rendering_and_status_reads_but_no_repr(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("KVBANK_SIDECAR_TOKEN", "s3cret-from-a-file\n")  # `echo` leaves one
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        config = OperatorConfig.from_args(parser.parse_args([]))
        # Stripped as `kvbank sidecar --token-file` strips what it reads, so the two agree.
        assert config.sidecar_token == config.render.sidecar_token == "s3cret-from-a-file"
        assert "s3cret" not in repr(config)

    def test_no_sidecar_token_is_none_and_a_bad_one_stops_the_operator(self) -> None:
        assert OperatorConfig.from_args(_parse()).render.sidecar_token is None
        assert OperatorConfig.from_args(_parse("--sidecar-token", "  ")).sidecar_token is None
        with pytest.raises(SystemExit, match="printable ASCII") as caught:
            OperatorConfig.from_args(_parse("--sidecar-token", "two words"))
        assert "two" not in str(caught.value)  # the message never echoes the token

    def test_cert_manager_needs_the_mounted_directory(self) -> None:
        with pytest.raises(SystemExit, match="--webhook-cert-dir"):
            OperatorConfig.from_args(_parse("--cert-mode", "cert-manager"))

    def test_the_console_script_knows_the_command(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as caught:
            cli.main(["operator", "--help"])
        assert caught.value.code == 0
        assert "--webhook-configuration" in capsys.readouterr().out


class TestPeering:
    def test_no_name_is_standalone(self) -> None:
        assert operator_main.peering(None) == operator_main.Peering(True, None, None)

    def test_replicas_draw_their_own_priorities(self) -> None:
        first, second = operator_main.peering("kvbank"), operator_main.peering("kvbank")
        assert first.standalone is False and first.name == "kvbank"
        assert first.priority is not None and first.priority > 0
        assert first.priority != second.priority  # equal ones would both pause

    def test_the_flag_and_its_variable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        assert OperatorConfig.from_args(_parse()).peering is None
        monkeypatch.setenv("KVBANK_PEERING", "kvbank-operator")
        assert OperatorConfig.from_args(_parse()).peering == "kvbank-operator"


def test_run_hands_kopf_the_registry_and_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    seen: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # so the one run() sets is undone
    args = _parse("--kubeconfig", str(kubeconfig), "--namespace", "team-a", "--cert-mode", "none")
    assert operator_main.run(args) == 0
    assert seen["namespaces"] == ["team-a"] and seen["clusterwide"] is False
    assert seen["standalone"] is True and seen["peering_name"] is None
    # no certificate, no webhook server: kopf would refuse to start with webhook handlers
    assert seen["registry"]._webhooks.get_all_handlers() == []
    reconcilers = {h.fn.__name__ for h in seen["registry"]._changing.get_all_handlers()}
    assert reconcilers == {"reconcile_pool"}
