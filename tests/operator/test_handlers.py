"""The kopf handlers, registered on a fresh registry with the in-memory cluster and called as
kopf would call them: thin wrappers whose only logic is turning API failures into retries
and refusals into AdmissionErrors."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import kopf
import pytest
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, pool_doc, stored

from kvbank.operator import config as operator_config
from kvbank.operator.cluster import KubeError
from kvbank.operator.handlers import Runtime, register
from kvbank.operator.live import PoolFigures
from kvbank.operator.render.names import config_name
from kvbank.operator.webhook_tls import ServerTLS

LOG = logging.getLogger("test")
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
GPT_OSS = (CONFIGS / "gpt-oss-20b.json").read_text()


def config_map_doc(text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "oss-config", "namespace": "team-a"},
        "data": {"config.json": text},
    }


class NoSidecars:
    async def status(
        self, address: str, timeout: float, server_name: str | None = None
    ) -> PoolFigures:
        raise ConnectionError("no sidecar in this test")


def _config(*flags: str) -> operator_config.OperatorConfig:
    parser = argparse.ArgumentParser()
    operator_config.add_arguments(parser)
    return operator_config.OperatorConfig.from_args(parser.parse_args(list(flags)))


def _setup(tls: bool = False) -> tuple[kopf.OperatorRegistry, Runtime, FakeCluster]:
    cluster = FakeCluster()
    cluster.put(namespace_doc("team-a"))
    runtime = Runtime(
        config=_config(
            "--webhook-configuration",
            "kvbank",
            "--cert-check-interval",
            "3600",
            "--sidecar-token",
            "t0ken-for-tests",
        ),
        cluster=cluster,
        source=NoSidecars(),
        tls=ServerTLS() if tls else None,
    )
    registry = kopf.OperatorRegistry()
    register(registry, runtime)
    return registry, runtime, cluster


def _handler(registry: kopf.OperatorRegistry, name: str) -> Any:
    for group in (registry._webhooks, registry._changing, registry._spawning, registry._activities):
        for handler in group.get_all_handlers():
            if handler.fn.__name__ == name:
                return handler.fn
    raise LookupError(name)


class TestRegistration:
    def test_handler_ids_are_the_webhook_paths(self) -> None:
        registry, _, _ = _setup(tls=True)
        ids = sorted(str(h.id) for h in registry._webhooks.get_all_handlers())
        assert ids == ["validate-capacitypolicy", "validate-modelpool", "validate-modelpool-scale"]

    def test_kopf_can_log_in(self) -> None:
        """A fresh registry has no login handler of kopf's; without one kopf cannot start."""
        registry, _, _ = _setup()
        names = {h.fn.__name__ for h in registry._activities.get_all_handlers()}
        assert {"login", "startup", "cleanup"} <= names

    def test_reconcile_runs_on_create_update_and_resume(self) -> None:
        registry, _, _ = _setup()
        causes = {
            (h.reason and str(h.reason.value), h.initial)
            for h in registry._changing.get_all_handlers()
            if h.fn.__name__ == "reconcile_pool"
        }
        assert causes == {("create", None), ("update", None), (None, True)}
        ids = {str(h.id) for h in registry._changing.get_all_handlers()}
        assert ids == {"reconcile"}  # kopf's progress annotation: kvbank.dev/reconcile
        assert any(h.fn.__name__ == "pool_status" for h in registry._spawning.get_all_handlers())


class TestValidate:
    def test_refusal_is_an_admission_error_with_every_violation(self) -> None:
        registry, _, _ = _setup(tls=True)
        validate = _handler(registry, "validate_modelpool")
        body = pool_doc(kv={"pageSize": 16, "pages": 400}, tensorParallel=3)
        with pytest.raises(kopf.AdmissionError) as caught:
            asyncio.run(validate(body=body, old=None))
        assert caught.value.code == 422
        text = str(caught.value)
        assert text.startswith("ModelPool team-a/llama: 3 violation(s):")
        assert asyncio.run(validate(body=pool_doc(), old=None)) is None

    def test_api_trouble_refuses_with_503(self) -> None:
        registry, _, cluster = _setup(tls=True)
        cluster.fail_after = 0
        with pytest.raises(kopf.AdmissionError) as caught:
            asyncio.run(_handler(registry, "validate_modelpool")(body=pool_doc(), old=None))
        assert caught.value.code == 503 and "cannot judge the ModelPool now" in str(caught.value)

    def test_policy_validation(self) -> None:
        registry, _, _ = _setup(tls=True)
        validate = _handler(registry, "validate_policy")
        bad = {
            "apiVersion": "kvbank.dev/v1alpha1",
            "kind": "CapacityPolicy",
            "metadata": {"name": "p"},
            "spec": {"limits": {"maxTokens": 0}},
        }
        with pytest.raises(kopf.AdmissionError, match="spec.limits.maxTokens: must be from 1"):
            asyncio.run(validate(body=bad))


class TestReconcileHandler:
    def test_applies_through_the_wrapper(self) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))
        body = cluster.one("ModelPool", "llama")
        asyncio.run(_handler(registry, "reconcile_pool")(body=body, logger=LOG))
        assert len(cluster.kinds("StatefulSet")) == 1

    def test_an_unavailable_api_becomes_a_retry(self) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))
        body = cluster.one("ModelPool", "llama")
        cluster.fail_after = 4
        with pytest.raises(kopf.TemporaryError) as caught:
            asyncio.run(_handler(registry, "reconcile_pool")(body=body, logger=LOG))
        assert caught.value.delay == 10.0

    def test_a_refused_request_becomes_a_slower_retry(self) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))

        async def forbidden(manifest: Any) -> Any:
            raise KubeError(403, "statefulsets is forbidden")

        cluster.apply = forbidden  # type: ignore[method-assign]
        body = cluster.one("ModelPool", "llama")
        with pytest.raises(kopf.TemporaryError, match="forbidden") as caught:
            asyncio.run(_handler(registry, "reconcile_pool")(body=body, logger=LOG))
        assert caught.value.delay == 60.0


class TestStartup:
    def test_configures_kopf_and_serves_its_own_certificate(self) -> None:
        registry, runtime, cluster = _setup(tls=True)
        cluster.put(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "kvbank"},
                "webhooks": [{"name": "modelpools.kvbank.dev", "clientConfig": {}}],
            }
        )
        settings = kopf.OperatorSettings()
        memo = kopf.Memo()

        async def start_and_stop() -> None:
            await _handler(registry, "startup")(settings=settings, memo=memo)
            await _handler(registry, "cleanup")(memo=memo)

        asyncio.run(start_and_stop())
        server = settings.admission.server
        assert isinstance(server, kopf.WebhookServer)
        assert (server.addr, server.port) == ("0.0.0.0", 9443)
        assert server.context is runtime.tls.context if runtime.tls else False
        assert settings.admission.managed is None
        assert settings.scanning.disabled  # no CRD or namespace watch to grant
        assert settings.persistence.progress_storage.prefix == "kvbank.dev"
        assert cluster.one("Secret", "kvbank-webhook-tls")["data"]["tls.crt"]
        hook = cluster.one("ValidatingWebhookConfiguration", "kvbank")["webhooks"][0]
        assert hook["clientConfig"]["caBundle"]
        assert memo["renewal"].cancelled()


class TestStatusTimer:
    def test_reads_pods_and_writes_status(self) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))
        asyncio.run(
            _handler(registry, "reconcile_pool")(body=cluster.one("ModelPool", "llama"), logger=LOG)
        )
        asyncio.run(_handler(registry, "pool_status")(body=cluster.one("ModelPool", "llama")))
        status = cluster.one("ModelPool", "llama")["status"]
        assert status["readyReplicas"] == 0
        assert {c["type"] for c in status["conditions"]} == {
            "Accepted",
            "Ready",
            "Degraded",
            "WeightsAvailable",
        }


class TestRepairTimer:
    def test_puts_back_a_deleted_stateful_set_and_says_so(self, caplog) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))
        body = cluster.one("ModelPool", "llama")
        asyncio.run(_handler(registry, "reconcile_pool")(body=body, logger=LOG))
        del cluster.objects[("apps/v1", "StatefulSet", "team-a", "llama")]
        with caplog.at_level(logging.WARNING, logger="test"):
            asyncio.run(
                _handler(registry, "repair_pool")(
                    body=cluster.one("ModelPool", "llama"), logger=LOG
                )
            )
        assert cluster.one("StatefulSet", "llama")["spec"]["replicas"] == 2
        assert "team-a/llama: restored StatefulSet/llama (missing)" in caplog.text

    def test_api_trouble_is_a_retry_not_a_crash(self) -> None:
        registry, _, cluster = _setup()
        cluster.put(stored(pool_doc()))
        asyncio.run(
            _handler(registry, "reconcile_pool")(body=cluster.one("ModelPool", "llama"), logger=LOG)
        )
        cluster.fail_after = 0
        with pytest.raises(kopf.TemporaryError):
            asyncio.run(
                _handler(registry, "repair_pool")(
                    body=cluster.one("ModelPool", "llama"), logger=LOG
                )
            )


def notify(changed: Any, event: str | None, pools: dict[tuple[str, str], list[str]]) -> None:
    """The watch handler called as kopf calls it for an event on ConfigMap team-a/oss-config."""
    asyncio.run(
        changed(
            type=event, name="oss-config", namespace="team-a", logger=LOG, pools_by_config_map=pools
        )
    )


class TestConfigMapWatch:
    """A pool whose config.json is a ConfigMap's is judged again when that ConfigMap changes,
    through the index of the pools that name one."""

    @staticmethod
    def _pool_and_config(cluster: FakeCluster, config: str) -> dict[str, Any]:
        doc = stored(
            pool_doc(
                "oss",
                model={
                    "name": "gpt-oss-20b",
                    "architecture": {"fromConfig": {"configMap": {"name": "oss-config"}}},
                },
                limits={"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
                kv={"pageSize": 16, "pages": 20000},
                engine={"kind": "vllm"},
            )
        )
        del doc["spec"]["kvSlots"]
        cluster.put(doc)
        cluster.put(config_map_doc(config))
        return doc

    @staticmethod
    def _handlers(registry: kopf.OperatorRegistry) -> tuple[Any, Any, Any]:
        (index,) = registry._indexing.get_all_handlers()
        (watch,) = registry._watching.get_all_handlers()
        assert str(index.id) == "pools_by_config_map" and str(watch.id) == "model-config"
        return index.fn, watch.when, watch.fn

    def test_the_index_names_the_config_map_of_each_pool_that_takes_one(self) -> None:
        registry, _, cluster = _setup()
        index, when, _ = self._handlers(registry)
        doc = self._pool_and_config(cluster, GPT_OSS)
        assert index(body=doc) == {("team-a", "oss-config"): "oss"}
        assert index(body=stored(pool_doc())) == {}
        pools = {("team-a", "oss-config"): ["oss"]}
        assert when(name="oss-config", namespace="team-a", pools_by_config_map=pools)
        assert not when(name="oss-engine-1", namespace="team-a", pools_by_config_map=pools)
        assert not when(name="oss-config", namespace="team-b", pools_by_config_map=pools)

    def test_an_edit_that_breaks_the_config_is_refused_and_the_pods_keep_running(self) -> None:
        registry, _, cluster = _setup()
        _, _, changed = self._handlers(registry)
        self._pool_and_config(cluster, GPT_OSS)
        body = cluster.one("ModelPool", "oss")
        asyncio.run(_handler(registry, "reconcile_pool")(body=body, logger=LOG))
        (running,) = cluster.kinds("StatefulSet")
        broken = json.dumps({**json.loads(GPT_OSS), "num_key_value_heads": -1})
        cluster.put(config_map_doc(broken))
        pools = {("team-a", "oss-config"): ["oss"]}
        notify(changed, "MODIFIED", pools)
        status = cluster.one("ModelPool", "oss")["status"]
        accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", "InvalidConfig")
        assert (
            "  - spec.model.architecture.fromConfig.configMap num_key_value_heads: must be from 1"
            in accepted["message"]
        )
        assert accepted["message"].endswith(
            f"The running pods keep the spec and config.json last accepted (ConfigMap "
            f"{config_name('oss', status['configHash'])}) until this is fixed."
        )
        assert cluster.kinds("StatefulSet") == [running]  # untouched
        # Fixed again: judged, rendered, accepted.
        cluster.put(config_map_doc(GPT_OSS))
        notify(changed, "MODIFIED", pools)
        status = cluster.one("ModelPool", "oss")["status"]
        accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
        assert accepted["status"] == "True"

    def test_the_initial_listing_and_a_pool_that_moved_on_are_left_alone(self) -> None:
        registry, _, cluster = _setup()
        _, _, changed = self._handlers(registry)
        self._pool_and_config(cluster, GPT_OSS)
        pools = {("team-a", "oss-config"): ["oss", "gone"]}
        notify(changed, None, pools)
        assert "status" not in cluster.one("ModelPool", "oss")
        moved = cluster.one("ModelPool", "oss")
        moved["spec"]["model"]["architecture"]["fromConfig"]["configMap"]["name"] = "other"
        cluster.put(moved)
        notify(changed, "MODIFIED", pools)
        assert "status" not in cluster.one("ModelPool", "oss")
