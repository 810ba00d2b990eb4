"""`helm lint` and `helm template` of charts/kvbank, checked against the operator's own code:
the environment the Deployment sets is what `kvbank operator` reads, the webhook paths are its
handler ids, and the ClusterRole grants what its builders apply. No cluster is needed."""

from __future__ import annotations

import argparse
import base64
import itertools
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from e2e_kube import CHART, FIRST_USE_TIMEOUT, ROOT, Tools, ensure_tools
from e2e_kube import example as load_example

from kvbank.capacity import holdability
from kvbank.deployment import parse_deployment
from kvbank.modelpool import parse_modelpool
from kvbank.operator import config as operator_config
from kvbank.operator.cluster import RESOURCES
from kvbank.operator.policy import parse_capacity_policy
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.operator.render.picker import PICKER_OBJECTS

KUBE_VERSION = "1.36.0"
pytestmark = pytest.mark.timeout(FIRST_USE_TIMEOUT)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Tools:
    # No cluster: the kubeconfig is never read; its folder is helm's HOME for its caches.
    return Tools(ensure_tools(), tmp_path_factory.mktemp("helm") / "kubeconfig")


def render(helm: Tools, *sets: str, expect_ok: bool = True, extra: tuple[str, ...] = ()) -> Any:
    args = ["template", "kvbank", str(CHART), "-n", "kvbank-system", "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    out = helm.helm(*args, *extra)
    if not expect_ok:
        assert out.returncode != 0, "helm template should have refused these values"
        return out.stderr
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind} rendered"
    return found[0]


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def secret_env_of(deployment: dict[str, Any]) -> dict[str, dict[str, str]]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name} rendered"
    return found[0]


def test_lint_passes_in_both_certificate_modes(helm: Tools) -> None:
    for mode in ("self-signed", "cert-manager"):
        out = helm.helm(
            "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
            "--set", f"certificates.mode={mode}",
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr


def test_default_render_has_exactly_the_operator_objects(helm: Tools) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterKopfPeering",  # which operator replica reconciles
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",  # the Grafana dashboard
        "Deployment",
        "PodDisruptionBudget",  # one operator replica through a drain
        "Role",
        "RoleBinding",
        "Secret",
        "Secret",
        "Service",
        "ServiceAccount",
        "ValidatingWebhookConfiguration",
    ]
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    peering = one(docs, "ClusterKopfPeering")["metadata"]["name"]
    assert env_of(deployment)["KVBANK_PEERING"] == peering == "kvbank-operator"
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert budget["minAvailable"] == 1
    assert budget["selector"] == deployment["spec"]["selector"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    service = one(docs, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_images_are_the_tags_the_containerfiles_build(helm: Tools) -> None:
    built = set()
    for path in (ROOT / "containers").glob("*.Containerfile"):
        built |= set(re.findall(r"-t (\S+:\S+) \.", path.read_text()))
    deployment = one(render(helm), "Deployment")
    operator_image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    env = env_of(deployment)
    assert built == {operator_image, env["KVBANK_IMAGE"], env["KVBANK_VLLM_IMAGE"]}
    # One registry prefix for all three.
    moved = one(render(helm, "image.registry=registry.corp.example/ml/"), "Deployment")
    moved_env = env_of(moved)
    assert moved["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.corp.example/ml/kvbank-operator:" + operator_image.rsplit(":", 1)[1]
    )
    assert moved_env["KVBANK_IMAGE"].startswith("registry.corp.example/ml/kvbank:")
    assert moved_env["KVBANK_VLLM_IMAGE"].startswith("registry.corp.example/ml/kvbank-vllm:")
    # A full reference (what the one-node tests set, and earlier values) is left alone.
    full = one(render(helm, "engine.image.repository=kvbank.local/kvbank"), "Deployment")
    assert env_of(full)["KVBANK_IMAGE"].startswith("kvbank.local/kvbank:")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert operator_image.endswith(":" + chart["appVersion"])


def parsed_operator_config(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    operator_config.add_arguments(parser)
    return operator_config.OperatorConfig.from_args(parser.parse_args([]))


def test_the_deployment_environment_is_what_the_operator_reads(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(
        helm, "operator.watchNamespaces={team-a,team-b}", "engine.gpuResource=amd.com/gpu"
    )
    config = parsed_operator_config(env_of(one(docs, "Deployment")), monkeypatch)
    assert config.namespaces == ("team-a", "team-b")
    assert config.tls.mode == "self-signed"
    assert config.tls.namespace == "kvbank-system"
    assert config.tls.secret_name == "kvbank-webhook-tls"
    assert named(docs, "Secret", "kvbank-webhook-tls").get("data") is None  # the operator fills it
    assert (
        config.tls.webhook_configuration
        == one(docs, "ValidatingWebhookConfiguration")["metadata"]["name"]
    )
    service = one(docs, "Service")["metadata"]["name"]
    assert f"{service}.kvbank-system.svc" in config.tls.names
    assert config.webhook_port == 9443
    assert config.render.image == "ghcr.io/kvbank/kvbank:0.1.0"
    assert config.render.gpu_resource == "amd.com/gpu"


def test_the_operator_gets_a_generated_sidecar_token_it_accepts(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(helm)
    secret = named(docs, "Secret", "kvbank-sidecar-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    deployment = one(docs, "Deployment")
    # By reference only: the token is in no literal value of the Deployment.
    assert secret_env_of(deployment) == {
        "KVBANK_SIDECAR_TOKEN": {"name": "kvbank-sidecar-token", "key": "token"}
    }
    assert token not in yaml.safe_dump(deployment)
    config = parsed_operator_config({**env_of(deployment), "KVBANK_SIDECAR_TOKEN": token},
                                    monkeypatch)  # fmt: skip
    assert config.sidecar_token == config.render.sidecar_token == token
    # Without a cluster to look it up in, each render draws a new one; an install keeps its own
    # across upgrades (tests/e2e/test_cluster.py).
    again = named(render(helm), "Secret", "kvbank-sidecar-token")
    assert again["data"]["token"] != secret["data"]["token"]


def test_an_existing_sidecar_token_secret_replaces_the_generated_one(helm: Tools) -> None:
    docs = render(
        helm, "sidecarToken.existingSecret=corp-token", "sidecarToken.existingSecretKey=value"
    )
    assert [s["metadata"]["name"] for s in by_kind(docs, "Secret")] == ["kvbank-webhook-tls"]
    assert secret_env_of(one(docs, "Deployment")) == {
        "KVBANK_SIDECAR_TOKEN": {"name": "corp-token", "key": "value"}
    }
    error = render(
        helm, "sidecarToken.existingSecret=corp-token", "sidecarToken.existingSecretKey=",
        expect_ok=False,
    )  # fmt: skip
    assert "sidecarToken.existingSecretKey is empty" in error


def test_webhook_configuration_follows_the_values(helm: Tools) -> None:
    handlers = (ROOT / "operator" / "handlers.py").read_text()
    for failure_policy in ("Fail", "Ignore"):
        docs = render(helm, f"webhook.failurePolicy={failure_policy}")
        hooks = one(docs, "ValidatingWebhookConfiguration")["webhooks"]
        assert [h["name"] for h in hooks] == [
            "modelpools.kvbank.dev",
            "scale.modelpools.kvbank.dev",
            "capacitypolicies.kvbank.dev",
        ]
        pools = hooks[0]
        assert pools["failurePolicy"] == failure_policy
        assert pools["sideEffects"] == "None"
        assert pools["admissionReviewVersions"] == ["v1"]
        assert pools["timeoutSeconds"] == 10
        assert pools["rules"] == [
            {
                "apiGroups": ["kvbank.dev"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["modelpools"],
                "scope": "Namespaced",
            }
        ]
        # `kubectl scale` (and an HPA) write the scale subresource: judged again for quota.
        assert hooks[1]["rules"] == [
            {
                "apiGroups": ["kvbank.dev"],
                "apiVersions": ["*"],
                "operations": ["UPDATE"],
                "resources": ["modelpools/scale"],
                "scope": "Namespaced",
            }
        ]
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            assert f'id="{path.lstrip("/")}"' in handlers, f"no operator handler serves {path}"
            assert "caBundle" not in hook["clientConfig"]  # the operator patches it in


def test_local_mode_points_the_apiserver_at_a_url(helm: Tools) -> None:
    docs = render(helm, "webhook.url=https://127.0.0.1:19443/")
    hooks = one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert [h["clientConfig"] for h in hooks] == [
        {"url": "https://127.0.0.1:19443/validate-modelpool"},
        {"url": "https://127.0.0.1:19443/validate-modelpool-scale"},
        {"url": "https://127.0.0.1:19443/validate-capacitypolicy"},
    ]
    error = render(helm, "webhook.url=http://127.0.0.1:19443", expect_ok=False)
    assert "webhook.url" in error and "https://" in error


def rules(docs: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    for doc in by_kind(docs, kind):
        yield from doc["rules"]


def granted(docs: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in rules(docs, "ClusterRole"):
        if group in rule["apiGroups"] and resource in rule["resources"]:
            assert "resourceNames" not in rule, f"{resource} must not be limited by name"
            verbs |= set(rule["verbs"])
    return verbs


# What the operator deletes (operator/pruning.py): ConfigMaps of earlier spec versions, and the
# kinds the picker renders once a pool is back to `spec.routing.picker: none`.
DELETED = {"configmaps"} | {RESOURCES[(v, kind)][0] for v, kind, _ in PICKER_OBJECTS}


def test_rbac_is_least_privilege(helm: Tools) -> None:
    docs = render(helm)
    everything = [*rules(docs, "ClusterRole"), *rules(docs, "Role")]
    for rule in everything:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert not {"deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
        if "delete" in rule["verbs"]:  # a pool's old ConfigMaps, the picker's objects it owns
            assert set(rule["resources"]) <= DELETED, rule
    secrets = [r for r in everything if "secrets" in r["resources"]]
    assert secrets == [
        # The pools' token and certificate Secrets, in their namespaces: created, certificates
        # renewed by whole-object update; never read, listed or patched.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "update"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["kvbank-webhook-tls"],
            "verbs": ["get", "update"],
        },
    ]
    hooks = [r for r in everything if "validatingwebhookconfigurations" in r["resources"]]
    assert [r["resourceNames"] for r in hooks] == [["kvbank-operator"]]
    assert granted(docs, "kvbank.dev", "modelpools/status") == {"patch"}
    assert granted(docs, "kvbank.dev", "capacitypolicies") == {"list"}
    # watch: the ConfigMaps fromConfig pools name, judged again on an edit
    assert granted(docs, "", "configmaps") == {"create", "patch", "get", "list", "watch", "delete"}
    assert granted(docs, "", "persistentvolumeclaims") == {"get"}


def test_rbac_covers_every_kind_the_builders_apply(helm: Tools) -> None:
    docs = render(helm)
    example = load_example("modelpool-llama-8b.yaml")
    pool = parse_modelpool(example)
    owner = Owner(pool.name, pool.namespace, "0000")
    settings = RenderSettings(sidecar_token="t0ken")
    routed = {**example, "spec": {**example["spec"], "routing": {"picker": "kvbank"}}}
    for workload, doc in itertools.product(Workload, (example, routed)):
        deployment = parse_deployment(doc)
        rendered = render_pool(pool, holdability(pool), owner, doc["spec"], settings, workload,
                               deployment)  # fmt: skip
        kinds = {m["kind"] for m in rendered.manifests}
        assert ("InferencePool" in kinds) == (doc is routed)
        # Created only (operator/render/token.py): exactly create, nothing that returns data.
        secret = rendered.token_secret
        assert RESOURCES[(secret["apiVersion"], secret["kind"])][0] == "secrets"
        assert granted(docs, "", "secrets") == {"create", "update"}
        for manifest in rendered.manifests:
            api_version, kind = manifest["apiVersion"], manifest["kind"]
            group = api_version.rpartition("/")[0]
            plural = RESOURCES[(api_version, kind)][0]
            # Server-side apply is a PATCH, authorised as create when the object is new; the
            # repair timer reads each one back.
            assert {"create", "patch", "get"} <= granted(docs, group, plural), kind
            # RBAC lets the operator grant only what it holds itself.
            for rule in manifest.get("rules", []) if kind == "Role" else []:
                for group, resource in itertools.product(rule["apiGroups"], rule["resources"]):
                    assert set(rule["verbs"]) <= granted(docs, group, resource), rule
    # A pool back to `picker: none` has the picker's objects listed by label and deleted.
    for api_version, kind, _ in PICKER_OBJECTS:
        plural = RESOURCES[(api_version, kind)][0]
        assert {"list", "delete"} <= granted(docs, api_version.rpartition("/")[0], plural), kind


def test_cert_manager_mode_renders_a_certificate_and_no_secret_rights(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(helm, "certificates.mode=cert-manager")
    assert [s["metadata"]["name"] for s in by_kind(docs, "Secret")] == ["kvbank-sidecar-token"]
    assert not by_kind(docs, "Role")
    certificate = one(docs, "Certificate")
    assert certificate["spec"]["secretName"] == "kvbank-webhook-tls"
    assert certificate["spec"]["dnsNames"][0] == "kvbank-webhook.kvbank-system.svc"
    assert one(docs, "Issuer")["spec"] == {"selfSigned": {}}
    hooks = one(docs, "ValidatingWebhookConfiguration")
    assert hooks["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "kvbank-system/kvbank-webhook-tls"
    }
    # Only the peering object is named: no webhook configuration or Secret right at all.
    assert [r["resources"] for r in rules(docs, "ClusterRole") if "resourceNames" in r] == [
        ["clusterkopfpeerings"]
    ]
    deployment = one(docs, "Deployment")
    config = parsed_operator_config(env_of(deployment), monkeypatch)
    assert config.tls.mode == "cert-manager"
    assert config.tls.webhook_configuration is None
    mounts = deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {
        "name": "webhook-tls",
        "mountPath": str(config.tls.cert_dir),
        "readOnly": True,
    } in mounts
    with_issuer = render(
        helm, "certificates.mode=cert-manager", "certificates.certManager.issuerRef.name=corp-ca",
        "certificates.certManager.issuerRef.kind=ClusterIssuer",
    )  # fmt: skip
    assert not by_kind(with_issuer, "Issuer")
    assert one(with_issuer, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
    }


def test_bad_values_are_refused_with_what_to_write(helm: Tools) -> None:
    error = render(helm, "certificates.mode=vault", expect_ok=False)
    assert 'certificates.mode is "vault"; use self-signed or cert-manager' in error
    error = render(helm, "webhook.failurePolicy=Maybe", expect_ok=False)
    assert 'webhook.failurePolicy is "Maybe"; use Fail or Ignore' in error


def test_network_policies_let_only_a_pools_own_ranks_reach_its_sidecars(helm: Tools) -> None:
    assert not by_kind(render(helm), "NetworkPolicy")
    docs = render(
        helm, "networkPolicy.enabled=true", "networkPolicy.namespaces={team-a}",
        "networkPolicy.pools[0].namespace=team-a", "networkPolicy.pools[0].name=llama-8b",
    )  # fmt: skip
    policies = {
        (p["metadata"]["namespace"], p["metadata"]["name"]): p
        for p in by_kind(docs, "NetworkPolicy")
    }
    assert set(policies) == {
        ("team-a", "kvbank-ranks"),
        ("team-a", "kvbank-sidecars-llama-8b"),
        ("kvbank-system", "kvbank-operator"),
    }
    settings = RenderSettings(sidecar_token="t0ken")
    base = policies[("team-a", "kvbank-ranks")]["spec"]
    open_ports = {p["port"] for rule in base["ingress"] for p in rule["ports"]}
    assert open_ports == {settings.http_port, settings.metrics_port}
    pool = policies[("team-a", "kvbank-sidecars-llama-8b")]["spec"]
    assert pool["podSelector"]["matchLabels"]["kvbank.dev/pool"] == "llama-8b"
    # Its own ranks on every port (torch.distributed's links use ports the kernel picks); the
    # operator on the sidecar's port only.
    ranks, status = pool["ingress"]
    assert ranks == {"from": [{"podSelector": pool["podSelector"]}]}
    assert status["ports"] == [{"port": settings.sidecar_port, "protocol": "TCP"}]
    [operator] = status["from"]
    assert operator["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "kvbank-system"}
    }
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    # The operator's rank pods carry every label the policies select on.
    example = load_example("modelpool-llama-8b.yaml")
    parsed = parse_modelpool(example)
    manifests = render_pool(
        parsed, holdability(parsed), Owner("llama-8b", "team-a", "0"), example["spec"],
        settings, Workload.STATEFUL_SET,
    ).manifests  # fmt: skip
    [workload] = [m for m in manifests if m["kind"] == "StatefulSet"]
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert pool["podSelector"]["matchLabels"].items() <= pod_labels.items()


def test_pod_monitor_only_when_asked_or_available(helm: Tools) -> None:
    api = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    assert not by_kind(render(helm), "PodMonitor")
    assert by_kind(render(helm, extra=api), "PodMonitor")
    assert not by_kind(render(helm, "metrics.podMonitor=false", extra=api), "PodMonitor")
    monitor = one(render(helm, "metrics.podMonitor=true"), "PodMonitor")
    pool_label = {
        "sourceLabels": ["__meta_kubernetes_pod_label_kvbank_dev_pool"],
        "targetLabel": "pool",
    }
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {
            "port": "metrics",
            "interval": "30s",
            "relabelings": [
                {"targetLabel": "container_role", "replacement": "sidecar"},
                pool_label,
            ],
        },
        {
            "port": "http",
            "path": "/metrics",
            "interval": "30s",
            "relabelings": [{"targetLabel": "container_role", "replacement": "engine"}, pool_label],
        },
    ]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_default_capacity_policy_is_one_the_operator_parses(helm: Tools) -> None:
    assert not by_kind(render(helm), "CapacityPolicy")
    docs = render(
        helm, "defaultCapacityPolicy.enabled=true",
        "defaultCapacityPolicy.spec.limits.gpusPerNamespace=8",
        "defaultCapacityPolicy.spec.limits.maxSeqLen=32768",
    )  # fmt: skip
    policy = parse_capacity_policy(one(docs, "CapacityPolicy"))
    assert policy.name == "kvbank-default"
    assert policy.limits.gpus_per_namespace == 8
    assert policy.limits.max_seq_len == 32768
