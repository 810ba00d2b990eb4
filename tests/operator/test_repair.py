"""Drift repair, the weights condition, the pools' sidecar certificates and the scale webhook,
against the in-memory cluster (its failure policy is the real client's)."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import pytest
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, policy_doc, pool_doc, stored

from kvbank.deployment import PvcSource
from kvbank.operator.admission import review, review_scale
from kvbank.operator.certs import CertBundle, new_ca
from kvbank.operator.cluster import KubeError
from kvbank.operator.pool_tls import POOL_CERT_LIFETIME, names_digest, renewal_due
from kvbank.operator.reconcile import reconcile, repair
from kvbank.operator.render.names import Owner, RenderSettings
from kvbank.operator.render.sidecar_tls import pool_tls_names
from kvbank.operator.repair import drift, why_repair
from kvbank.operator.weights_status import check_condition, claim_condition

SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")
NOW = "2026-01-01T00:00:00Z"
WEIGHTS_SPEC = {
    "name": "llama-3.1-8b-instruct",
    "architecture": {"preset": "llama-3.1-8b"},
    "source": {"pvc": {"claimName": "weights"}},
}


def _issuer() -> CertBundle:
    ca, key = new_ca(datetime(2026, 1, 1, tzinfo=UTC))
    return CertBundle(ca, key, b"", b"", ca)


def _setup(*docs: dict[str, Any]) -> FakeCluster:
    cluster = FakeCluster()
    cluster.put(namespace_doc("team-a"))
    for doc in docs:
        cluster.put(doc)
    return cluster


def _reconcile(cluster: FakeCluster, issuer: CertBundle | None = None, now: str = NOW) -> Any:
    doc = cluster.one("ModelPool", "llama")
    return asyncio.run(reconcile(cluster, SETTINGS, doc, now=now, issuer=issuer))


def _repair(cluster: FakeCluster, issuer: CertBundle | None = None, now: str = NOW) -> Any:
    doc = cluster.one("ModelPool", "llama")
    return asyncio.run(repair(cluster, SETTINGS, doc, now=now, issuer=issuer))


def _condition(cluster: FakeCluster, kind: str) -> dict[str, Any]:
    status = cluster.one("ModelPool", "llama").get("status") or {}
    (found,) = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found


class TestDrift:
    STS: ClassVar[dict[str, Any]] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "llama", "labels": {"a": "b"}},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 1}}}
                    ],
                    "volumes": [{"name": "dshm", "emptyDir": {"sizeLimit": "1024Mi"}}],
                }
            },
        },
    }

    def _live(self) -> dict[str, Any]:
        live = copy.deepcopy(self.STS)
        live["metadata"].update(uid="u", resourceVersion="9", annotations={"x": "y"})
        container = live["spec"]["template"]["spec"]["containers"][0]
        container["resources"]["limits"]["nvidia.com/gpu"] = "1"  # as the apiserver writes it
        container["terminationMessagePath"] = "/dev/termination-log"  # a default
        live["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "1Gi"
        live["status"] = {"replicas": 2}
        return live

    def test_defaults_and_canonical_quantities_are_not_drift(self) -> None:
        assert why_repair(self.STS, self._live()) is None

    def test_a_missing_object_is_repaired(self) -> None:
        assert why_repair(self.STS, None) == "missing"

    def test_an_edited_field_is_drift_named_by_its_path(self) -> None:
        live = self._live()
        live["spec"]["replicas"] = 5
        live["metadata"]["labels"] = {}
        assert why_repair(self.STS, live) == "drifted at .metadata.labels.a, .spec.replicas"

    def test_a_list_that_lost_an_entry_is_drift(self) -> None:
        live = self._live()
        live["spec"]["template"]["spec"]["volumes"] = []
        assert drift(self.STS["spec"], live["spec"]) == [".template.spec.volumes"]


class TestRepair:
    def test_a_pool_never_judged_is_left_to_reconcile(self) -> None:
        cluster = _setup(stored(pool_doc()))
        assert _repair(cluster) is None
        assert not cluster.kinds("StatefulSet")

    def test_nothing_is_applied_while_nothing_drifted(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster)
        before = copy.deepcopy(cluster.objects)
        cluster.calls.clear()
        outcome = _repair(cluster)
        assert outcome.applied == ()
        assert not [c for c in cluster.calls if c[0] in ("apply", "patch/status")]
        assert cluster.objects == before

    def test_a_deleted_stateful_set_and_service_come_back(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster)
        sts = copy.deepcopy(cluster.one("StatefulSet", "llama"))
        del cluster.objects[("apps/v1", "StatefulSet", "team-a", "llama")]
        del cluster.objects[("v1", "Service", "team-a", "llama")]
        outcome = _repair(cluster)
        assert outcome.applied == ("Service/llama (missing)", "StatefulSet/llama (missing)")
        assert cluster.one("StatefulSet", "llama")["spec"] == sts["spec"]

    def test_a_hand_edited_replica_count_is_set_back(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster)
        cluster.one("StatefulSet", "llama")["spec"]["replicas"] = 7
        outcome = _repair(cluster)
        assert outcome.applied == ("StatefulSet/llama (drifted at .spec.replicas)",)
        assert cluster.one("StatefulSet", "llama")["spec"]["replicas"] == 2

    def test_what_the_apiserver_drops_is_confirmed_by_a_dry_run_and_left(self) -> None:
        """A field a disabled feature gate drops (a StatefulSet's maxUnavailable) reads as
        drift every pass; the dry-run apply shows the apiserver would store the same, so
        nothing is applied."""
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster)
        strategy = cluster.one("StatefulSet", "llama")["spec"]["updateStrategy"]
        del strategy["rollingUpdate"]
        real_apply = cluster.apply

        async def dropping(manifest: Any, dry_run: bool = False) -> Any:
            result = await real_apply(manifest, dry_run)
            result.get("spec", {}).get("updateStrategy", {}).pop("rollingUpdate", None)
            return result

        cluster.apply = dropping  # type: ignore[method-assign]
        cluster.calls.clear()
        assert _repair(cluster).applied == ()
        assert ("apply/dry-run", "StatefulSet/llama") in cluster.calls
        assert ("apply", "StatefulSet/llama") not in cluster.calls

    def test_a_deleted_token_secret_is_created_again(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster)
        (secret,) = cluster.kinds("Secret")
        del cluster.objects[("v1", "Secret", "team-a", secret["metadata"]["name"])]
        assert _repair(cluster).applied == (f"Secret/{secret['metadata']['name']}",)
        assert cluster.kinds("Secret")[0]["data"] == secret["data"]


class TestRenderRefused:
    def test_an_apply_the_apiserver_refuses_becomes_the_condition(self) -> None:
        cluster = _setup(stored(pool_doc()))

        async def refuse(manifest: Any) -> Any:
            if manifest["kind"] == "StatefulSet":
                raise KubeError(422, "StatefulSet.apps is invalid: spec.template.spec.affinity")
            return cluster.put(manifest)

        cluster.apply = refuse  # type: ignore[method-assign]
        outcome = _reconcile(cluster)
        assert not outcome.accepted
        accepted = _condition(cluster, "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", "RenderRefused")
        assert "the apiserver refused the rendered StatefulSet/llama" in accepted["message"]
        assert "Fix the spec.template field it names" in accepted["message"]


class TestWeightsCondition:
    def test_a_missing_then_unbound_then_bound_claim(self) -> None:
        cluster = _setup(stored(pool_doc(model=WEIGHTS_SPEC)))
        _reconcile(cluster)
        cond = _condition(cluster, "WeightsAvailable")
        assert (cond["status"], cond["reason"]) == ("False", "ClaimNotFound")
        assert "PersistentVolumeClaim team-a/weights does not exist" in cond["message"]
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "weights", "namespace": "team-a"},
            "status": {"phase": "Pending"},
        }
        cluster.put(claim)
        _repair(cluster)
        assert _condition(cluster, "WeightsAvailable")["reason"] == "ClaimNotBound"
        claim.update(status={"phase": "Bound"}, spec={"volumeName": "pv-1"})
        cluster.put(claim)
        _repair(cluster)
        cond = _condition(cluster, "WeightsAvailable")
        assert (cond["status"], cond["reason"]) == ("True", "ClaimBound")
        assert "Bound to PersistentVolume pv-1" in cond["message"]

    def test_a_claim_condition_names_the_sub_path(self) -> None:
        cond = claim_condition("ns", PvcSource("w", "llama"), None)
        assert "holding the model folder at llama" in cond.message

    def test_a_failed_check_in_a_pod_says_what_is_missing(self) -> None:
        line = "kvbank: weights missing: no readable config.json in /models/llama (from x)"
        pod = {
            "metadata": {"name": "llama-0"},
            "status": {
                "initContainerStatuses": [
                    {
                        "name": "weights-check",
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 1, "message": line + "\n"}},
                    }
                ]
            },
        }
        cond = check_condition([pod, {"metadata": {"name": "llama-1"}, "status": {}}])
        assert cond is not None and (cond.status, cond.reason) == (False, "WeightsCheckFailed")
        assert (
            cond.message == f"1 pod(s) found no usable weights where --model looks: llama-0: {line}"
        )
        assert check_condition([{"metadata": {"name": "ok"}, "status": {}}]) is None


class TestPoolCertificates:
    def test_issued_once_recorded_in_status_and_mounted(self) -> None:
        cluster = _setup(stored(pool_doc()))
        issuer = _issuer()
        _reconcile(cluster, issuer)
        secret = cluster.one("Secret", "llama-sidecar-tls")
        assert secret["type"] == "kubernetes.io/tls"
        record = cluster.one("ModelPool", "llama")["status"]["sidecarTLS"]
        template = cluster.one("StatefulSet", "llama")["spec"]["template"]
        assert (
            template["metadata"]["annotations"]["kvbank.dev/sidecar-tls-serial"] == record["serial"]
        )
        before = copy.deepcopy(cluster.objects)
        _repair(cluster, issuer)
        _reconcile(cluster, issuer)
        assert cluster.objects == before  # nothing re-issued while it is good

    def test_renewed_when_a_third_of_its_life_is_left_and_the_pods_roll(self) -> None:
        cluster = _setup(stored(pool_doc()))
        issuer = _issuer()
        _reconcile(cluster, issuer)
        first = cluster.one("ModelPool", "llama")["status"]["sidecarTLS"]["serial"]
        later = (datetime(2026, 1, 1, tzinfo=UTC) + POOL_CERT_LIFETIME * 0.7).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        _repair(cluster, issuer, now=later)
        second = cluster.one("ModelPool", "llama")["status"]["sidecarTLS"]["serial"]
        assert second != first
        template = cluster.one("StatefulSet", "llama")["spec"]["template"]
        assert template["metadata"]["annotations"]["kvbank.dev/sidecar-tls-serial"] == second

    def test_why_renewal_is_due(self) -> None:
        owner = Owner("llama", "team-a", "u")
        names = pool_tls_names(owner)
        now = datetime(2026, 1, 1, tzinfo=UTC)
        good = {
            "serial": "1",
            "notAfter": (now + timedelta(days=80)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "names": names_digest(names),
            "ca": "ca1",
        }
        assert renewal_due(good, names, "ca1", now) is None
        assert renewal_due({}, names, "ca1", now) == "none issued"
        assert renewal_due(good, names[:-1], "ca1", now) == "its names changed"
        assert renewal_due(good, names, "ca2", now) == "the operator's CA changed"
        assert renewal_due(good, names, "ca1", now + timedelta(days=60)) == (
            "a third of its life is left"
        )

    def test_an_operator_without_a_token_issues_nothing(self) -> None:
        cluster = _setup(stored(pool_doc()))
        doc = cluster.one("ModelPool", "llama")
        untokened = RenderSettings(image="registry.example/kvbank:1.2.3")
        outcome = asyncio.run(reconcile(cluster, untokened, doc, now=NOW, issuer=_issuer()))
        assert not outcome.accepted
        assert cluster.kinds("Secret") == [] and cluster.kinds("StatefulSet") == []

    def test_without_a_ca_the_pods_run_on_a_trusted_network(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _reconcile(cluster, None)
        assert "sidecarTLS" not in cluster.one("ModelPool", "llama")["status"]
        sidecar = cluster.one("StatefulSet", "llama")["spec"]["template"]["spec"]["containers"][1]
        assert sidecar["args"][-1] == "--trusted-network"


class TestScaleReview:
    def _cluster(self) -> FakeCluster:
        cluster = _setup(stored(pool_doc()), policy_doc("four", {"gpusPerNamespace": 4}, {}))
        return cluster

    def test_a_scale_within_quota_is_admitted(self) -> None:
        assert asyncio.run(review_scale(self._cluster(), "team-a", "llama", 4)) is None

    def test_a_scale_over_quota_is_refused_naming_the_room(self) -> None:
        refusal = asyncio.run(review_scale(self._cluster(), "team-a", "llama", 5))
        assert refusal is not None
        assert "would use 5 GPUs" in refusal and "Lower replicas to at most 4" in refusal

    def test_gpus_per_rank_count_against_the_quota(self) -> None:
        cluster = self._cluster()
        doc = pool_doc(template={"resources": {"gpusPerRank": 2}})
        refusal = asyncio.run(review(cluster, doc, None))
        assert refusal is None  # 2 replicas x 1 x 2 = 4
        refusal = asyncio.run(
            review(cluster, pool_doc(replicas=3, template={"resources": {"gpusPerRank": 2}}), None)
        )
        assert refusal is not None and "x gpusPerRank 2" in refusal
        assert "Lower replicas to at most 2" in refusal


class TestWarnings:
    def test_a_host_path_is_admitted_with_a_warning(self) -> None:
        warnings: list[str] = []
        doc = pool_doc(model={**WEIGHTS_SPEC, "source": {"hostPath": {"path": "/srv/llama"}}})
        assert asyncio.run(review(FakeCluster(), doc, None, warnings=warnings)) is None
        assert warnings == [
            "spec.model.source.hostPath (/srv/llama) is for development only: every node must "
            "have it, and Pod Security baseline and restricted refuse it. Use "
            "spec.model.source.pvc in production."
        ]

    @pytest.mark.parametrize("source", [{"pvc": {"claimName": "w"}}, None])
    def test_other_sources_bring_no_warning(self, source: Any) -> None:
        model = {k: v for k, v in WEIGHTS_SPEC.items() if k != "source"}
        if source:
            model["source"] = source
        warnings: list[str] = []
        asyncio.run(review(FakeCluster(), pool_doc(model=model), None, warnings=warnings))
        assert warnings == []
