"""Against the real kube-apiserver, with the chart installed and the operator under its
ServiceAccount (the `cluster` fixture of test_cluster): children that vanish or drift come back,
`kubectl scale modelpool` drives the pool and is judged against capacity policy, and the
ModelPool's pod-facing fields are judged by CEL and the webhook with messages that say what to
change. No kubelet runs, so the assertions are on the stored objects."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml
from e2e_kube import CHART, FIRST_USE_TIMEOUT, ROOT, condition, example, wait_for
from test_cluster import POOL_SELECTOR, RELEASE, SETTLE_TIMEOUT, SYSTEM, Cluster, cluster

__all__ = ["cluster"]  # the fixture, shared with test_cluster
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(FIRST_USE_TIMEOUT)]
POOL = "llama-8b"
REPAIR_TIMEOUT = 30.0  # the operator runs with --repair-interval 3


def rendered_pool(cluster: Cluster, prefix: str, **spec: Any) -> tuple[str, dict[str, Any]]:
    ns = cluster.namespace(prefix)
    doc = example("modelpool-llama-8b.yaml", ns)
    doc["spec"].update(spec)
    out = cluster.admin.apply(doc)
    assert out.returncode == 0, out.stderr
    cluster.accepted(ns, POOL)
    sts = wait_for("the StatefulSet", lambda: cluster.admin.get("statefulset", POOL, ns), 30)
    return ns, sts


def restored(cluster: Cluster, what: str, kind: str, name: str, ns: str, old_uid: str) -> Any:
    def probe() -> dict[str, Any] | None:
        obj = cluster.admin.get(kind, name, ns)
        return obj if obj and obj["metadata"]["uid"] != old_uid else None

    started = time.monotonic()
    try:
        found = wait_for(what, probe, REPAIR_TIMEOUT)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{cluster.operator.log_tail()}") from None
    print(f"{what}: {time.monotonic() - started:.1f} s (repair interval 3 s)")
    return found


def test_a_deleted_stateful_set_is_restored(cluster: Cluster) -> None:
    ns, sts = rendered_pool(cluster, "drift-sts")
    cluster.admin.ok("delete", "statefulset", POOL, "-n", ns, "--wait=false")
    back = restored(
        cluster, "the StatefulSet back", "statefulset", POOL, ns, sts["metadata"]["uid"]
    )
    assert back["spec"]["replicas"] == 2
    assert (
        back["spec"]["template"]["metadata"]["annotations"]
        == sts["spec"]["template"]["metadata"]["annotations"]
    )
    assert f"restored StatefulSet/{POOL} (missing)" in cluster.operator.log_tail(200)


def test_a_hand_edited_replica_count_is_set_back(cluster: Cluster) -> None:
    ns, sts = rendered_pool(cluster, "drift-scale")
    cluster.admin.ok("scale", "statefulset", POOL, "-n", ns, "--replicas", "5")

    def set_back() -> bool:
        current = cluster.admin.get("statefulset", POOL, ns)
        return current is not None and current["spec"]["replicas"] == 2

    wait_for("replicas set back to 2", set_back, REPAIR_TIMEOUT)
    assert cluster.admin.get("statefulset", POOL, ns)["metadata"]["uid"] == sts["metadata"]["uid"]  # type: ignore[index]
    assert "drifted at .spec.replicas" in cluster.operator.log_tail(200)


def test_deleted_services_are_restored(cluster: Cluster) -> None:
    ns, _ = rendered_pool(cluster, "drift-svc")
    services = {
        s["metadata"]["name"]: s
        for s in cluster.admin.items("services", ns, POOL_SELECTOR.format(POOL))
    }
    assert set(services) == {POOL, f"{POOL}-ranks"}
    cluster.admin.ok("delete", "service", POOL, f"{POOL}-ranks", "-n", ns)
    for name, old in services.items():
        back = restored(
            cluster, f"Service {name} back", "service", name, ns, old["metadata"]["uid"]
        )
        assert back["spec"]["selector"] == old["spec"]["selector"]


def test_a_deleted_certificate_secret_is_issued_again_and_rolls_the_pods(cluster: Cluster) -> None:
    ns, sts = rendered_pool(cluster, "drift-tls")
    before = cluster.pool(ns, POOL)["status"]["sidecarTLS"]  # type: ignore[index]
    template = sts["spec"]["template"]
    assert template["metadata"]["annotations"]["kvbank.dev/sidecar-tls-serial"] == before["serial"]
    engine, sidecar = template["spec"]["containers"]
    assert "--tls-cert-file" in sidecar["args"] and "--sidecar-ca-file" in engine["args"]
    # The operator may not read the Secret it made; the admin can, and deletes it.
    old = cluster.admin.get("secret", f"{POOL}-sidecar-tls", ns)
    assert old is not None and old["type"] == "kubernetes.io/tls"
    cluster.admin.ok("delete", "secret", f"{POOL}-sidecar-tls", "-n", ns)
    restored(
        cluster, "the certificate back", "secret", f"{POOL}-sidecar-tls", ns, old["metadata"]["uid"]
    )

    def rolled() -> dict[str, Any] | None:
        current = cluster.admin.get("statefulset", POOL, ns) or {}
        annotations = current.get("spec", {}).get("template", {}).get("metadata", {})
        serial = annotations.get("annotations", {}).get("kvbank.dev/sidecar-tls-serial")
        return current if serial and serial != before["serial"] else None

    wait_for("the pods rolled onto the new certificate", rolled, REPAIR_TIMEOUT)


def scale(cluster: Cluster, ns: str, replicas: int) -> Any:
    return cluster.admin.kubectl("scale", "modelpool", POOL, "-n", ns, f"--replicas={replicas}")


def test_kubectl_scale_drives_the_pool(cluster: Cluster) -> None:
    ns, _ = rendered_pool(cluster, "scale")
    out = scale(cluster, ns, 3)
    assert out.returncode == 0, out.stderr

    def scaled() -> bool:
        sts = cluster.admin.get("statefulset", POOL, ns)
        return sts is not None and sts["spec"]["replicas"] == 3

    wait_for("the StatefulSet at 3 replicas", scaled, SETTLE_TIMEOUT)
    path = f"/apis/kvbank.dev/v1alpha1/namespaces/{ns}/modelpools/{POOL}/scale"

    def reported() -> dict[str, Any] | None:
        view = json.loads(cluster.admin.ok("get", "--raw", path))
        return view if view["status"].get("replicas") == 3 else None

    view = wait_for("the Scale reporting 3", reported, SETTLE_TIMEOUT)
    assert view["spec"]["replicas"] == 3
    assert view["status"]["selector"] == f"app.kubernetes.io/name=kvbank,kvbank.dev/pool={POOL}"


def test_a_scale_over_the_gpu_quota_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    label = f"kvbank-e2e/scale-quota-{cluster.suffix}"
    ns = cluster.namespace("scale-quota", {label: "two"})
    policy = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "CapacityPolicy",
        "metadata": {"name": f"two-gpus-{cluster.suffix}"},
        "spec": {
            "namespaceSelector": {"matchLabels": {label: "two"}},
            "limits": {"gpusPerNamespace": 2},
        },
    }
    assert cluster.admin.apply(policy).returncode == 0
    try:
        out = cluster.admin.apply(example("modelpool-llama-8b.yaml", ns))
        assert out.returncode == 0, out.stderr
        cluster.accepted(ns, POOL)
        out = scale(cluster, ns, 3)
        assert out.returncode != 0
        assert "would use 3 GPUs" in out.stderr and "gpusPerNamespace is 2" in out.stderr
        assert "Lower replicas to at most 2" in out.stderr
        assert cluster.pool(ns, POOL)["spec"]["replicas"] == 2  # type: ignore[index]
        # GPUs per rank count too: two per rank is four GPUs for the same two replicas.
        doubled = example("modelpool-llama-8b.yaml", ns)
        doubled["spec"]["template"]["resources"]["gpusPerRank"] = 2
        out = cluster.admin.apply(doubled)
        assert out.returncode != 0
        assert "x gpusPerRank 2" in out.stderr and "would use 4 GPUs" in out.stderr
    finally:
        cluster.admin.kubectl("delete", "capacitypolicy", policy["metadata"]["name"])


def refused(cluster: Cluster, ns: str, name: str, **spec: Any) -> str:
    doc = example("modelpool-llama-8b.yaml", ns, name=name)
    for key, value in spec.items():
        section, _, field = key.partition("__")
        if field:
            doc["spec"][section][field] = value
        else:
            doc["spec"][section] = value
    out = cluster.admin.apply(doc)
    assert out.returncode != 0, f"{name} was accepted"
    assert cluster.pool(ns, name) is None
    return out.stderr


def test_the_pod_fields_are_judged_with_what_to_change(cluster: Cluster) -> None:
    ns = cluster.namespace("pod-fields")
    two = {"pvc": {"claimName": "w"}, "hostPath": {"path": "/models"}}
    error = refused(cluster, ns, "two-sources", model__source=two)
    assert "set exactly one of pvc, hostPath, image, huggingFace" in error
    error = refused(cluster, ns, "vllm-flag", engine={"kind": "vllm", "args": ["--block-size=32"]})
    assert "spec.engine.args sets a flag the operator renders for vllm" in error
    error = refused(cluster, ns, "bad-shm", template={"shmSize": "lots"})
    assert "shmSize" in error
    # Past the schema, the webhook's own rules: a toleration value with operator Exists.
    bad_toleration = {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]}
    error = refused(cluster, ns, "bad-toleration", template=bad_toleration)
    assert "must be empty with operator Exists; drop it or use Equal" in error


def test_a_host_path_source_is_admitted_with_a_warning(cluster: Cluster) -> None:
    ns = cluster.namespace("host-path")
    doc = example("modelpool-llama-8b.yaml", ns)
    doc["spec"]["model"]["source"] = {"hostPath": {"path": "/srv/models/llama"}}
    out = cluster.admin.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    assert out.returncode == 0, out.stderr
    assert (
        "Warning: spec.model.source.hostPath (/srv/models/llama) is for development only"
        in out.stderr
    )
    cluster.accepted(ns, POOL)
    sts = wait_for("the StatefulSet", lambda: cluster.admin.get("statefulset", POOL, ns), 30)
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["weights"]["hostPath"] == {"path": "/srv/models/llama", "type": "Directory"}


def weights_reason(cluster: Cluster, ns: str) -> str | None:
    cond = condition(cluster.pool(ns, POOL), "WeightsAvailable")
    return cond["reason"] if cond else None


def test_the_weights_condition_follows_the_claim(cluster: Cluster) -> None:
    ns, _ = rendered_pool(cluster, "weights")
    wait_for("ClaimNotFound", lambda: weights_reason(cluster, ns) == "ClaimNotFound", 30)
    message = condition(cluster.pool(ns, POOL), "WeightsAvailable")["message"]  # type: ignore[index]
    assert f"PersistentVolumeClaim {ns}/llama-3-1-8b-weights does not exist" in message
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "llama-3-1-8b-weights", "namespace": ns},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    assert cluster.admin.apply(claim).returncode == 0
    wait_for(
        "ClaimNotBound", lambda: weights_reason(cluster, ns) == "ClaimNotBound", REPAIR_TIMEOUT
    )
    # No controller-manager runs here: bind it as the volume binder would.
    cluster.admin.ok(
        "patch", "pvc", "llama-3-1-8b-weights", "-n", ns, "--subresource=status", "--type=merge",
        "-p", '{"status": {"phase": "Bound"}}',
    )  # fmt: skip
    wait_for("ClaimBound", lambda: weights_reason(cluster, ns) == "ClaimBound", REPAIR_TIMEOUT)


def test_vllm_and_an_api_key_render_as_the_interfaces_say(cluster: Cluster) -> None:
    _, sts = rendered_pool(
        cluster,
        "vllm",
        engine={
            "kind": "vllm",
            "image": "registry.example/kvbank-vllm:1",
            "args": ["--enforce-eager"],
        },
        apiKeySecret={"name": "llama-keys"},
        tensorParallel=2,
    )
    assert sts["spec"]["replicas"] == 2  # one pod per group: vLLM runs both ranks
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"] == "registry.example/kvbank-vllm:1"
    args = engine["args"]
    # The API keys' file read into one --api-key by a shell step, then vllm serve.
    assert args[:2] == ["/bin/sh", "-c"] and args[3] == "vllm-api-keys"
    assert args[4:7] == ["vllm", "serve", "/models/llama-3.1-8b-instruct"]
    assert args[args.index("--served-model-name") + 1] == "llama-3.1-8b-instruct"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--num-gpu-blocks-override") + 1] == "20000"
    assert args[-1] == "--enforce-eager"
    env = {e["name"]: e for e in engine["env"]}
    assert env["KVBANK_POLICY"]["value"] == "peak+backfill"
    assert env["KVBANK_SIDECAR"]["value"] == "unix:///var/run/kvbank/sidecar/admission.sock"
    assert env["KVBANK_API_KEY_FILE"]["value"] == "/etc/kvbank/api-key/api-key"
    assert "VLLM_API_KEY" not in env
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-key"]["secret"]["secretName"] == "llama-keys"
    assert engine["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}


def test_helm_upgrade_with_the_example_values_installs_the_example_pool(cluster: Cluster) -> None:
    cluster.admin.ok("create", "namespace", "team-a")
    out = cluster.admin.helm(
        "upgrade", RELEASE, str(CHART), "-n", SYSTEM, "--reuse-values",
        "-f", str(ROOT / "examples" / "values-llama-8b.yaml"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cluster.accepted("team-a", POOL)
    claim = cluster.admin.get("pvc", "llama-3-1-8b-weights", "team-a")
    assert claim is not None and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # No volume binds it here (no controller-manager): the pool says so.
    wait_for("ClaimNotBound", lambda: weights_reason(cluster, "team-a") == "ClaimNotBound", 30)
    sts = wait_for("the StatefulSet", lambda: cluster.admin.get("statefulset", POOL, "team-a"), 30)
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"]["persistentVolumeClaim"]["claimName"] == "llama-3-1-8b-weights"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert config_map_of_dashboard(cluster) is not None


def config_map_of_dashboard(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.admin.get("configmap", "kvbank-dashboard", SYSTEM)


def test_an_untouched_pool_is_never_repaired(cluster: Cluster) -> None:
    """What the apiserver defaults and canonicalises is not drift: a pool left alone for
    several repair passes is never applied again."""
    ns, sts = rendered_pool(
        cluster,
        "quiet",
        template={
            "resources": {"cpu": "500m", "memory": "1024Mi"},
            "shmSize": "1024Mi",
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                        ]
                    }
                }
            },
        },
    )
    time.sleep(10)  # three passes at --repair-interval 3
    assert (
        cluster.admin.get("statefulset", POOL, ns)["metadata"]["resourceVersion"]
        == sts[  # type: ignore[index]
            "metadata"
        ]["resourceVersion"]
    )
    repaired = [
        line
        for log in cluster.operator.logs
        for line in log.read_text(errors="replace").splitlines()
        if f"{ns}/{POOL}: restored" in line
    ]
    assert repaired == []
