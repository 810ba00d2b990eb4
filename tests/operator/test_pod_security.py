"""The rank pods' hardening, one class per builder of render.security, and every rendered pod
judged by the Pod Security "restricted" profile (tests/operator/pod_security.py)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
from operator_specs import pool_doc
from pod_security import violations

from kvbank.deployment import parse_deployment, parse_template
from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.admission import dev_warnings
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.operator.render.security import (
    cache_env,
    container_security_context,
    engine_probes,
    harden,
    pod_security_context,
    scratch_volumes,
    sidecar_probes,
)
from kvbank.operator.render.sidecar_tls import PoolTLS
from kvbank.operator.render.workloads import workload

SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")
OWNER = Owner("llama", "team-a", "uid-7")
MODEL = {"name": "llama-3.1-8b-instruct", "architecture": {"preset": "llama-3.1-8b"}}
SOURCES = {
    "none": None,
    "pvc": {"pvc": {"claimName": "weights", "subPath": "llama"}},
    "image-copy": {"image": {"reference": "registry.example/llama:1", "path": "/w"}},
    "huggingFace": {
        "huggingFace": {"repo": "meta-llama/Llama-3.1-8B", "tokenSecret": {"name": "hf"}}
    },
}


def _template(kind: Workload = Workload.STATEFUL_SET, tls: bool = True, **spec: Any):
    doc = pool_doc(**spec)
    pool, deployment = parse_modelpool(doc), parse_deployment(doc)
    rendered = workload(
        kind,
        pool,
        OWNER,
        SETTINGS,
        "h",
        "llama-sidecar-token-0123456789",
        deployment,
        PoolTLS("llama-sidecar-tls", "abc") if tls else None,
    )
    spec_ = rendered["spec"]
    if kind is Workload.LEADER_WORKER_SET:
        return spec_["leaderWorkerTemplate"]["workerTemplate"]
    return spec_["template"]


def _with_source(name: str) -> dict[str, Any]:
    source = SOURCES[name]
    return {**MODEL, "source": source} if source else MODEL


def _all_containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return [*template["spec"]["initContainers"], *template["spec"]["containers"]]


class TestPodSecurityContext:
    def test_a_numeric_non_root_user_group_and_runtime_default_seccomp(self) -> None:
        assert pod_security_context() == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        }


class TestContainerSecurityContext:
    def test_drops_everything_and_writes_nothing_of_its_image(self) -> None:
        assert container_security_context() == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }


class TestScratch:
    def test_two_bounded_empty_dirs(self) -> None:
        assert scratch_volumes() == [
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "cache", "emptyDir": {"sizeLimit": "16Gi"}},
        ]

    def test_home_and_every_cache_on_the_cache_volume(self) -> None:
        assert cache_env() == [
            {"name": "HOME", "value": "/var/cache/kvbank"},
            {"name": "XDG_CACHE_HOME", "value": "/var/cache/kvbank/.cache"},
            {"name": "XDG_CONFIG_HOME", "value": "/var/cache/kvbank/.config"},
            {"name": "TRITON_CACHE_DIR", "value": "/var/cache/kvbank/.cache/triton"},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/var/cache/kvbank/.cache/torchinductor"},
        ]


class TestHarden:
    def test_adds_the_context_and_one_tmp_mount(self) -> None:
        container = {"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/tmp"}]}
        hardened = harden(container)
        assert hardened["securityContext"] == container_security_context()
        assert hardened["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
        assert container == {"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/tmp"}]}


class TestProbes:
    LIVE: ClassVar[dict[str, Any]] = {"httpGet": {"path": "/health/live", "port": "http"}}
    READY: ClassVar[dict[str, Any]] = {"httpGet": {"path": "/health", "port": "http"}}

    def test_the_engine_gets_thirty_minutes_to_load_then_a_minute_to_answer(self) -> None:
        probes = engine_probes("http")
        assert probes == {
            "startupProbe": {
                **self.LIVE, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 360,
            },
            "readinessProbe": {
                **self.READY, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3,
            },
            "livenessProbe": {
                **self.LIVE, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6,
            },
        }  # fmt: skip
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 1800

    def test_the_sidecar_starts_within_a_minute(self) -> None:
        probe = {"grpc": {"port": 50051}}
        assert sidecar_probes(probe) == {
            "startupProbe": {**probe, "periodSeconds": 2, "failureThreshold": 30},
            "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {
                **probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6,
            },
        }  # fmt: skip


class TestRestrictedProfile:
    @pytest.mark.parametrize("source", sorted(SOURCES))
    @pytest.mark.parametrize("kind", list(Workload))
    @pytest.mark.parametrize("engine", ["kvbank", "vllm"])
    @pytest.mark.parametrize("tls", [True, False])
    def test_every_rendered_pod_passes(
        self, source: str, kind: Workload, engine: str, tls: bool
    ) -> None:
        template = _template(
            kind,
            tls,
            model=_with_source(source),
            engine={"kind": engine},
            template={"resources": {"cpu": "8", "memory": "64Gi"}, "shmSize": "8Gi"},
            apiKeySecret={"name": "keys"},
        )
        assert violations(template) == []

    def test_every_container_has_requests_and_a_memory_limit(self) -> None:
        template = _template(
            model=_with_source("huggingFace"),
            template={"resources": {"cpu": "8", "memory": "64Gi"}},
        )
        containers = _all_containers(template)
        assert [c["name"] for c in containers] == [
            "weights-download", "weights-check", "engine", "sidecar",
        ]  # fmt: skip
        for container in containers:
            assert container["resources"]["requests"], container["name"]
            assert container["resources"]["limits"]["memory"], container["name"]
        engine = template["spec"]["containers"][0]
        assert engine["resources"]["limits"]["memory"] == "64Gi"

    def test_the_engine_probes_and_the_sidecars(self) -> None:
        engine, sidecar = _template()["spec"]["containers"]
        assert {k: v for k, v in engine.items() if k.endswith("Probe")} == engine_probes("http")
        assert {k: v for k, v in sidecar.items() if k.endswith("Probe")} == sidecar_probes(
            {"tcpSocket": {"port": "grpc"}}
        )

    def test_the_checker_catches_what_the_hardening_prevents(self) -> None:
        template = _template(model=_with_source("pvc"))
        weakened = copy.deepcopy(template)
        del weakened["spec"]["securityContext"]
        check = weakened["spec"]["initContainers"][0]
        check["securityContext"] = {"allowPrivilegeEscalation": True}
        weakened["spec"]["containers"][1]["securityContext"]["capabilities"] = {"add": ["NET_RAW"]}
        assert violations(weakened) == [
            "spec.containers[1](sidecar).securityContext.capabilities.add ['NET_RAW'] beyond "
            "baseline",
            "spec.initContainers[0](weights-check).securityContext.allowPrivilegeEscalation "
            "must be false",
            "spec.initContainers[0](weights-check).securityContext.runAsNonRoot must be true "
            "(here or on the pod)",
            "spec.initContainers[0](weights-check).securityContext.seccompProfile must be "
            "RuntimeDefault or Localhost",
            "spec.initContainers[0](weights-check).securityContext.capabilities.drop must "
            "include ALL",
            "spec.containers[1](sidecar).securityContext.capabilities.drop must include ALL",
            "spec.containers[1](sidecar).securityContext.capabilities.add may hold only "
            "NET_BIND_SERVICE",
        ]

    def test_a_host_path_source_is_the_one_that_cannot_pass_and_the_webhook_says_so(self) -> None:
        doc = pool_doc(model={**MODEL, "source": {"hostPath": {"path": "/srv/llama"}}})
        template = _template(model=doc["spec"]["model"])
        assert violations(template) == [
            "spec.volumes[2](weights) is a hostPath volume",
            "spec.volumes[2](weights) is of type ['hostPath']",
        ]
        [warning] = dev_warnings(parse_deployment(doc))
        assert "Pod Security baseline and restricted refuse it" in warning
        assert len(warning) < 256  # the apiserver may truncate a longer warning


class TestTemplateMayOnlyAdd:
    ADDED: ClassVar[dict[str, Any]] = {
        "supplementalGroups": [2000],
        "seLinuxOptions": {"type": "container_t", "level": "s0:c123,c456"},
        "appArmorProfile": {"type": "Localhost", "localhostProfile": "kvbank-rank"},
    }

    def test_a_field_of_the_hardening_is_refused_naming_it(self) -> None:
        doc = pool_doc(template={"securityContext": {"runAsUser": 0, "privileged": True}})
        with pytest.raises(SpecError) as caught:
            parse_deployment(doc)
        errors = sorted(str(e) for e in caught.value.errors)
        assert [e.split(":")[0] for e in errors] == [
            "spec.template.securityContext.privileged",
            "spec.template.securityContext.runAsUser",
        ]
        for error in errors:
            assert "is not a field a pool sets: the operator sets it on every rank pod" in error
            assert "a pool may add only supplementalGroups, seLinuxOptions, appArmorProfile" in (
                error
            )

    def test_what_restricted_refuses_is_refused_within_the_additions(self) -> None:
        bad = {
            "supplementalGroups": [0],
            "seLinuxOptions": {"type": "spc_t", "user": "root"},
            "appArmorProfile": {"type": "Unconfined"},
        }
        with pytest.raises(SpecError) as caught:
            parse_deployment(pool_doc(template={"securityContext": bad}))
        fields = sorted(str(e).split(":")[0] for e in caught.value.errors)
        assert fields == [
            "spec.template.securityContext.appArmorProfile.type",
            "spec.template.securityContext.seLinuxOptions.type",
            "spec.template.securityContext.seLinuxOptions.user",
            "spec.template.securityContext.supplementalGroups[0]",
        ]

    def test_the_additions_are_rendered_under_the_hardening_and_still_pass(self) -> None:
        template = _template(template={"securityContext": self.ADDED})
        assert template["spec"]["securityContext"] == {**self.ADDED, **pod_security_context()}
        assert violations(template) == []

    def test_the_charts_defaults_may_add_too_and_a_pools_own_replace_them(self) -> None:
        defaults = parse_template({"securityContext": {"supplementalGroups": [3000]}})
        mine = parse_deployment(pool_doc(template={"securityContext": self.ADDED})).template
        assert mine.over(defaults).security == mine.security
        plain = parse_deployment(pool_doc()).template
        assert plain.over(defaults).security == defaults.security
