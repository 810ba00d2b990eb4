"""The users' commands against a real kube-apiserver: `helm install` the chart, `kubectl apply`
ModelPools, with the operator as a local process holding only the chart's ServiceAccount token.

The tests run in file order and share one control plane, release and operator (module
fixtures): each step builds on the cluster the previous ones left, as a user's session would.
No kubelet or controller-manager runs, so pods never start and nothing is garbage-collected:
the tests assert on the stored objects, and every pool lives in a namespace of its own (deleting
a namespace would never finish)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_kube import (
    CHART,
    FIRST_USE_TIMEOUT,
    TOOLS,
    Operator,
    Tools,
    condition,
    ensure_tools,
    example,
    free_port,
    service_account_kubeconfig,
    wait_for,
)

from kvbank.capacity import holdability
from kvbank.modelpool import parse_modelpool

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(FIRST_USE_TIMEOUT)]

SYSTEM = "kvbank-system"
RELEASE = "kvbank"
TOKEN_SECRET = "kvbank-sidecar-token"  # the chart's generated one
TOKEN_FILE = "/var/run/kvbank/sidecar-token/token"
ACCOUNT = "kvbank-operator"
CRDS = ("modelpools.kvbank.dev", "capacitypolicies.kvbank.dev")
POOL_SELECTOR = "kvbank.dev/pool={}"
START_TIMEOUT = 180.0
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
SETTLE_TIMEOUT = 60.0


@dataclass
class Cluster:
    admin: Tools
    operator_tools: Tools  # kubectl as the operator's ServiceAccount
    operator: Operator
    webhook_port: int
    suffix: str
    sidecar_token: str = field(repr=False)

    def namespace(self, prefix: str, labels: dict[str, str] | None = None) -> str:
        """A fresh namespace per test: none is ever deleted, since no namespace controller runs."""
        name = f"{prefix}-{self.suffix}"
        meta: dict[str, Any] = {"name": name, "labels": labels or {}}
        doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}
        out = self.admin.apply(doc)
        assert out.returncode == 0, out.stderr
        return name

    def pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.admin.get("modelpool", name, namespace)

    def accepted(self, namespace: str, name: str, timeout: float = SETTLE_TIMEOUT) -> Any:
        def probe() -> dict[str, Any] | None:
            doc = self.pool(namespace, name)
            cond = condition(doc, "Accepted")
            if cond and cond["status"] == "True" and doc:
                generation = doc["metadata"]["generation"]
                if doc["status"].get("observedGeneration") == generation:
                    return doc
            return None

        try:
            return wait_for(f"ModelPool {namespace}/{name} Accepted=True", probe, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log:\n{self.operator.log_tail()}") from None


def webhook_answers(admin: Tools) -> bool:
    """A server-side dry run reaches the webhook (failurePolicy Fail): it passes only once the
    operator serves with the CA the apiserver was given."""
    doc = example("modelpool-llama-8b.yaml", "default", name="probe")
    out = admin.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc))
    return out.returncode == 0


def chart_token(admin: Tools) -> str:
    """The token the chart generated, as the operator's Deployment would get it."""
    secret = admin.get("secret", TOKEN_SECRET, SYSTEM)
    assert secret is not None, "the chart rendered no sidecar token Secret"
    return base64.b64decode(secret["data"]["token"]).decode()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    bin_dir = ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="kvbank-e2e-"))
    operator: Operator | None = None
    try:
        started = time.monotonic()
        out = subprocess.run(
            ["bash", str(TOOLS), "start", str(work)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT + 60,
            check=False,
        )
        assert out.returncode == 0, f"tools.sh start failed:\n{out.stderr[-4000:]}"
        admin = Tools(bin_dir, Path(out.stdout.strip().splitlines()[-1]))
        print(f"control plane ready in {time.monotonic() - started:.1f} s")

        port = free_port()
        install = admin.helm(
            "install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace",
            "--set", f"webhook.url=https://127.0.0.1:{port}",
        )  # fmt: skip
        assert install.returncode == 0, install.stderr
        admin.ok(
            "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{c}" for c in CRDS)
        )

        sa_config = service_account_kubeconfig(admin, ACCOUNT, SYSTEM, work / "operator.kubeconfig")
        token = chart_token(admin)
        operator = Operator(sa_config, SYSTEM, port, work, sidecar_token=token)
        operator.start()
        try:
            wait_for("the operator's webhook", lambda: webhook_answers(admin), 120, every=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log:\n{operator.log_tail()}") from None
        yield Cluster(admin, Tools(bin_dir, sa_config), operator, port, uuid.uuid4().hex[:6], token)
    finally:
        if operator is not None:
            operator.stop()
        subprocess.run(["bash", str(TOOLS), "stop", str(work)], timeout=60, check=False)
        shutil.rmtree(work, ignore_errors=True)


def owned(cluster: Cluster, namespace: str, pool: str) -> dict[str, list[dict[str, Any]]]:
    """Every object of the kinds a pool renders that carries the pool's label, by kind."""
    selector = POOL_SELECTOR.format(pool)
    kinds = ("configmaps", "secrets", "services", "statefulsets", "poddisruptionbudgets")
    return {kind: cluster.admin.items(kind, namespace, selector) for kind in kinds}


def test_install_establishes_the_crds_and_the_operator_fills_its_certificate(
    cluster: Cluster,
) -> None:
    for crd in CRDS:
        established = condition(cluster.admin.get("crd", crd), "Established")
        assert established is not None and established["status"] == "True", crd
    hooks = cluster.admin.get("validatingwebhookconfiguration", "kvbank-operator")
    assert hooks is not None
    ca_bundles = {h["clientConfig"].get("caBundle") for h in hooks["webhooks"]}
    secret = cluster.admin.get("secret", "kvbank-webhook-tls", SYSTEM)
    assert secret is not None and set(secret["data"]) >= {"ca.crt", "tls.crt", "tls.key"}
    # The apiserver trusts exactly the CA bundle the operator wrote next to its certificate.
    assert ca_bundles == {secret["data"]["ca-bundle.crt"]}
    urls = [h["clientConfig"]["url"] for h in hooks["webhooks"]]
    assert urls == [
        f"https://127.0.0.1:{cluster.webhook_port}/validate-modelpool",
        f"https://127.0.0.1:{cluster.webhook_port}/validate-modelpool-scale",
        f"https://127.0.0.1:{cluster.webhook_port}/validate-capacitypolicy",
    ]


def can_i(tools: Tools, *args: str) -> str:
    return tools.kubectl("auth", "can-i", *args).stdout.strip()


def test_the_operator_holds_only_the_charts_rights(cluster: Cluster) -> None:
    sa = cluster.operator_tools
    assert can_i(sa, "patch", "modelpools.kvbank.dev", "--subresource=status", "-n", "x") == "yes"
    assert can_i(sa, "patch", "statefulsets.apps", "-n", "x") == "yes"
    assert can_i(sa, "delete", "statefulsets.apps", "-n", "x") == "no"
    assert can_i(sa, "create", "capacitypolicies.kvbank.dev") == "no"
    assert can_i(sa, "get", "secrets/kvbank-webhook-tls", "-n", SYSTEM) == "yes"
    assert can_i(sa, "get", "secrets/other", "-n", SYSTEM) == "no"
    assert can_i(sa, "list", "secrets", "-n", SYSTEM) == "no"
    # A pool's token Secret: created in its namespace, and nothing that returns a Secret's data.
    assert can_i(sa, "create", "secrets", "-n", "x") == "yes"
    # Renewing a pool's sidecar certificate is a whole-object update, which returns only what
    # the operator sent; nothing that returns a Secret's data.
    assert can_i(sa, "update", "secrets", "-n", "x") == "yes"
    for verb in ("get", "list", "watch", "patch", "delete"):
        assert can_i(sa, verb, "secrets", "-n", "x") == "no", verb
    assert can_i(sa, "update", "validatingwebhookconfigurations/kvbank-operator") == "yes"
    assert can_i(sa, "update", "validatingwebhookconfigurations/someone-else") == "no"


def test_a_holdable_pool_is_accepted_and_rendered(cluster: Cluster) -> None:
    ns = cluster.namespace("team-a")
    doc = example("modelpool-llama-8b.yaml", ns)
    out = cluster.admin.apply(doc)
    assert out.returncode == 0, out.stderr
    held = holdability(parse_modelpool(doc))
    pool = cluster.accepted(ns, "llama-8b")
    status = pool["status"]
    assert status["worstConcurrency"] == held.worst_concurrency == 38
    assert status["worstRequestPages"] == held.worst_request_pages == 513
    assert status["pages"] == 20000
    assert "holds 38 worst-case requests" in condition(pool, "Accepted")["message"]  # type: ignore[index]

    objects = wait_for("every rendered object", lambda: _all_rendered(cluster, ns, "llama-8b"), 30)
    uid = pool["metadata"]["uid"]
    for kind, items in objects.items():
        for item in items:
            [ref] = item["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"], ref["controller"]) == ("ModelPool", uid, True), kind
    secrets = {s["type"]: s for s in objects["secrets"]}
    secret, tls = secrets["Opaque"], secrets["kubernetes.io/tls"]
    assert tls["metadata"]["name"] == "llama-8b-sidecar-tls"
    assert set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"]["token"]).decode() == cluster.sidecar_token
    [sts] = objects["statefulsets"]
    assert sts["spec"]["replicas"] == 2  # replicas 2 x tensorParallel 1
    assert sts["spec"]["serviceName"] == "llama-8b-ranks"
    template = sts["spec"]["template"]
    assert template["metadata"]["annotations"]["kvbank.dev/config-hash"] == status["configHash"]
    assert [c["name"] for c in template["spec"]["containers"]] == ["engine", "sidecar"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["sidecar-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    engine, sidecar = template["spec"]["containers"]
    for container in (engine, sidecar):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["sidecar-token"]["readOnly"] is True
        assert mounts["sidecar-token"]["mountPath"] == TOKEN_FILE.rsplit("/", 1)[0]
    assert sidecar["args"][sidecar["args"].index("--token-file") + 1] == TOKEN_FILE
    assert engine["args"][engine["args"].index("--sidecar-token-file") + 1] == TOKEN_FILE
    # The engine calls its sidecar on a socket in an emptyDir both mount, as the apiserver kept it.
    socket = engine["args"][engine["args"].index("--sidecar") + 1]
    assert socket.startswith("unix:///") and socket in sidecar["args"]
    assert "emptyDir" in volumes["sidecar-socket"]
    for container in (engine, sidecar):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert socket.startswith(f"unix://{mounts['sidecar-socket']['mountPath']}/")
    services = {s["metadata"]["name"]: s["spec"] for s in objects["services"]}
    assert services["llama-8b-ranks"]["clusterIP"] == "None"
    # One pod per group: every pod is a rank 0, selected by the pool's labels alone.
    assert services["llama-8b"]["selector"] == {
        "app.kubernetes.io/name": "kvbank",
        "kvbank.dev/pool": "llama-8b",
    }
    [pdb] = objects["poddisruptionbudgets"]
    assert pdb["spec"]["maxUnavailable"] == 1
    [config] = objects["configmaps"]
    stored = yaml.safe_load(config["data"]["modelpool.yaml"])
    assert parse_modelpool(stored) == parse_modelpool(doc)
    engine = yaml.safe_load(config["data"]["engine.json"])
    assert (engine["poolPages"], engine["worstConcurrency"]) == (20000, 38)


def _all_rendered(cluster: Cluster, ns: str, pool: str) -> dict[str, list[dict[str, Any]]] | None:
    objects = owned(cluster, ns, pool)
    counts = {kind: len(items) for kind, items in objects.items()}
    expected = {
        "configmaps": 1,
        "secrets": 2,  # the sidecar token and the sidecar certificate
        "services": 2,
        "statefulsets": 1,
        "poddisruptionbudgets": 1,
    }
    return objects if counts == expected else None


def test_an_unholdable_pool_is_rejected_naming_what_to_change(cluster: Cluster) -> None:
    ns = cluster.namespace("team-b")
    out = cluster.admin.apply(example("modelpool-unholdable.yaml", ns))
    assert out.returncode != 0
    assert "kv.pages=400 cannot hold one worst-case request" in out.stderr
    assert "Raise kv.pages to at least 514" in out.stderr
    assert cluster.pool(ns, "llama-8b-tiny-pool") is None


def test_a_pool_read_from_a_config_map_is_judged_on_its_layout(cluster: Cluster) -> None:
    """gpt-oss-20b's config.json in a ConfigMap: refused while the ConfigMap is missing, then
    judged on its 12 sliding and 12 full attention layers, each group in the status, and
    rendered for vLLM with the config it was judged on beside the ranks' manifest."""
    ns = cluster.namespace("from-config")
    pool = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": "oss", "namespace": ns},
        "spec": {
            "model": {
                "name": "gpt-oss-20b",
                "architecture": {"fromConfig": {"configMap": {"name": "gpt-oss-20b"}}},
            },
            "gpu": {"memoryGiB": 80},
            "kv": {"pageSize": 16, "pages": 20000},
            "limits": {"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
            "engine": {"kind": "vllm"},
        },
    }
    out = cluster.admin.apply(pool)
    assert out.returncode != 0
    assert (
        "spec.model.architecture.fromConfig.configMap.name: names ConfigMap gpt-oss-20b, which "
        f"namespace {ns} does not have" in out.stderr
    )
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gpt-oss-20b", "namespace": ns},
        "data": {"config.json": (CONFIGS / "gpt-oss-20b.json").read_text()},
    }
    assert cluster.admin.apply(config).returncode == 0
    out = cluster.admin.apply(pool)
    assert out.returncode == 0, out.stderr

    def judged() -> dict[str, Any] | None:
        doc = cluster.pool(ns, "oss")
        cond = condition(doc, "Accepted")
        return doc if cond and cond["reason"] == "Holdable" else None

    doc = wait_for("the configured pool judged", judged, SETTLE_TIMEOUT)
    status = doc["status"]
    assert (status["pages"], status["worstRequestPages"], status["worstConcurrency"]) == (
        20000,
        777,
        25,
    )
    assert status["groups"] == [
        {
            "name": "sliding",
            "kind": "sliding",
            "layers": 12,
            "pageBytes": 393216,
            "rule": "window 128: at most 265 pages",
            "worstRequestPages": 265,
        },
        {
            "name": "full",
            "kind": "full",
            "layers": 12,
            "pageBytes": 393216,
            "rule": "every position",
            "worstRequestPages": 512,
        },
    ]
    assert condition(doc, "Accepted")["status"] == "True"  # type: ignore[index]
    (rendered,) = [
        c for c in owned(cluster, ns, "oss")["configmaps"] if "model-config.json" in c["data"]
    ]
    assert json.loads(rendered["data"]["model-config.json"]) == json.loads(
        config["data"]["config.json"]
    )
    (running,) = owned(cluster, ns, "oss")["statefulsets"]

    # An edit of the ConfigMap is judged again (the operator watches it), without a spec change.
    broken = json.loads(config["data"]["config.json"])
    broken["num_key_value_heads"] = -1
    edited = {**config, "data": {"config.json": json.dumps(broken)}}
    assert cluster.admin.apply(edited).returncode == 0

    def refused() -> dict[str, Any] | None:
        doc = cluster.pool(ns, "oss")
        cond = condition(doc, "Accepted")
        return doc if cond and cond["reason"] == "InvalidConfig" else None

    doc = wait_for("the edited config judged again", refused, SETTLE_TIMEOUT)
    text = condition(doc, "Accepted")["message"]  # type: ignore[index]
    assert "spec.model.architecture.fromConfig.configMap num_key_value_heads" in text
    assert "The running pods keep the spec and config.json last accepted" in text
    (still,) = owned(cluster, ns, "oss")["statefulsets"]
    assert still["metadata"]["uid"] == running["metadata"]["uid"]
    assert still["spec"] == running["spec"]  # nothing rendered from the refused config


def test_a_capacity_policy_quota_rejects_a_pool_that_passes_without_it(cluster: Cluster) -> None:
    quota_label = f"kvbank-e2e/quota-{cluster.suffix}"
    ns = cluster.namespace("quota", {quota_label: "small"})
    doc = example("modelpool-llama-8b.yaml", ns)
    dry = cluster.admin.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc))
    assert dry.returncode == 0, dry.stderr  # the pool itself is holdable
    policy_name = f"one-gpu-{cluster.suffix}"
    policy: dict[str, Any] = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "CapacityPolicy",
        "metadata": {"name": policy_name},
        "spec": {
            "namespaceSelector": {"matchLabels": {quota_label: "small"}},
            "limits": {"gpusPerNamespace": 1},
        },
    }
    out = cluster.admin.apply(policy)
    assert out.returncode == 0, out.stderr
    try:
        out = cluster.admin.apply(doc)
        assert out.returncode != 0
        assert f"CapacityPolicy one-gpu-{cluster.suffix}" in out.stderr
        assert "would use 2 GPUs" in out.stderr and "gpusPerNamespace is 1" in out.stderr
        assert "Lower replicas to at most 1" in out.stderr
        assert cluster.pool(ns, "llama-8b") is None
        doc["spec"]["replicas"] = 1  # what the message asked for
        out = cluster.admin.apply(doc)
        assert out.returncode == 0, out.stderr
        assert cluster.accepted(ns, "llama-8b")["status"]["replicas"] == 1
    finally:
        cluster.admin.kubectl("delete", "capacitypolicy", policy_name)


def test_the_operator_killed_mid_reconcile_converges_with_nothing_duplicated(
    cluster: Cluster,
) -> None:
    ns = cluster.namespace("crash")
    doc = example("modelpool-llama-8b.yaml", ns)
    out = cluster.admin.apply(doc)
    assert out.returncode == 0, out.stderr
    # Killed as soon as reconcile has applied its first object (the ConfigMap), before it can
    # have reported Accepted: the rest is left for the restarted operator.
    wait_for(
        "the first rendered object",
        lambda: cluster.admin.items("configmaps", ns, POOL_SELECTOR.format("llama-8b")),
        SETTLE_TIMEOUT,
        every=0.02,
    )
    cluster.operator.kill()
    at_kill = condition(cluster.pool(ns, "llama-8b"), "Accepted")
    cluster.operator.start()
    pool = cluster.accepted(ns, "llama-8b")
    objects = wait_for("every rendered object", lambda: _all_rendered(cluster, ns, "llama-8b"), 30)
    for kind, items in objects.items():
        for item in items:
            assert len(item["metadata"]["ownerReferences"]) == 1, kind
    assert pool["status"]["worstConcurrency"] == 38
    print(f"Accepted at the kill: {at_kill}")
    wait_for("the restarted webhook", lambda: webhook_answers(cluster.admin), 60, every=1)


def test_helm_upgrade_keeps_the_certificate_and_adds_what_the_values_ask(
    cluster: Cluster,
) -> None:
    before = cluster.admin.get("secret", "kvbank-webhook-tls", SYSTEM)
    token_before = cluster.admin.get("secret", TOKEN_SECRET, SYSTEM)
    ns = cluster.namespace("upgraded")
    out = cluster.admin.helm(
        "upgrade", RELEASE, str(CHART), "-n", SYSTEM, "--reuse-values",
        "--set", "webhook.failurePolicy=Ignore",
        # Rendered objects the apiserver (and, for the policy, the webhook) must accept.
        "--set", "networkPolicy.enabled=true",
        "--set", f"networkPolicy.namespaces={{{ns}}}",
        "--set", f"networkPolicy.pools[0].namespace={ns}",
        "--set", "networkPolicy.pools[0].name=llama-8b",
        "--set", "defaultCapacityPolicy.enabled=true",
        "--set", "defaultCapacityPolicy.spec.limits.maxSeqLen=131072",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    policies = cluster.admin.ok("get", "networkpolicies", "-A", "-o", "name").split()
    assert sorted(policies) == [
        "networkpolicy.networking.k8s.io/kvbank-operator",
        "networkpolicy.networking.k8s.io/kvbank-ranks",
        "networkpolicy.networking.k8s.io/kvbank-sidecars-llama-8b",
    ]
    default = cluster.admin.get("capacitypolicy", "kvbank-default")
    assert default is not None and default["spec"]["limits"] == {"maxSeqLen": 131072}
    hooks = cluster.admin.get("validatingwebhookconfiguration", "kvbank-operator")
    assert hooks is not None
    assert {h["failurePolicy"] for h in hooks["webhooks"]} == {"Ignore"}
    after = cluster.admin.get("secret", "kvbank-webhook-tls", SYSTEM)
    assert before is not None and after is not None and after["data"] == before["data"]
    # lookup found the generated token: the upgrade kept it, so no pool's pods roll.
    token_after = cluster.admin.get("secret", TOKEN_SECRET, SYSTEM)
    assert token_before is not None and token_after is not None
    assert token_after["data"] == token_before["data"]
    assert chart_token(cluster.admin) == cluster.sidecar_token
    assert {h["clientConfig"].get("caBundle") for h in hooks["webhooks"]} == {
        after["data"]["ca-bundle.crt"]
    }
    # The apiserver still reaches the webhook with the kept CA bundle.
    assert webhook_answers(cluster.admin)


def test_cel_alone_rejects_with_the_operator_stopped_and_reconcile_judges_what_slipped_past(
    cluster: Cluster,
) -> None:
    cluster.operator.stop()
    ns = cluster.namespace("no-operator")
    bad = example("modelpool-llama-8b.yaml", ns, name="bad")
    bad["spec"]["limits"] = {"maxSeqLen": 4096, "maxTokens": 4096}
    out = cluster.admin.apply(bad)
    assert out.returncode != 0
    assert "maxTokens must be below maxSeqLen (4096) so a prompt fits, got 4096" in out.stderr
    # failurePolicy Ignore: a holdable pool is stored unjudged, then judged by the operator.
    good = example("modelpool-llama-8b.yaml", ns)
    out = cluster.admin.apply(good)
    assert out.returncode == 0, out.stderr
    assert condition(cluster.pool(ns, "llama-8b"), "Accepted") is None
    cluster.operator.start()
    assert cluster.accepted(ns, "llama-8b")["status"]["worstConcurrency"] == 38
    wait_for("the restarted webhook", lambda: webhook_answers(cluster.admin), 60, every=1)


def test_an_operator_without_a_token_renders_no_pods_and_says_how_to_set_it(
    cluster: Cluster,
) -> None:
    cluster.operator.stop()
    cluster.operator.sidecar_token = None
    try:
        cluster.operator.start()
        ns = cluster.namespace("no-token")
        out = cluster.admin.apply(example("modelpool-llama-8b.yaml", ns))
        assert out.returncode == 0, out.stderr  # the spec itself is fine

        def refused() -> dict[str, Any] | None:
            cond = condition(cluster.pool(ns, "llama-8b"), "Accepted")
            return cond if cond and cond["reason"] == "SidecarTokenMissing" else None

        cond = wait_for("Accepted=False for want of a token", refused, SETTLE_TIMEOUT)
        assert cond["status"] == "False"
        assert "set KVBANK_SIDECAR_TOKEN or --sidecar-token" in cond["message"]
        ready = condition(cluster.pool(ns, "llama-8b"), "Ready")
        assert ready is not None and ready["reason"] == "SidecarTokenMissing"
        assert all(items == [] for items in owned(cluster, ns, "llama-8b").values())
    finally:
        cluster.operator.stop()
        cluster.operator.sidecar_token = cluster.sidecar_token
        cluster.operator.start()
    # Given the token, the restarted operator renders the pool it refused.
    cluster.accepted(ns, "llama-8b")
    wait_for("every rendered object", lambda: _all_rendered(cluster, ns, "llama-8b"), 30)
    wait_for("the restarted webhook", lambda: webhook_answers(cluster.admin), 60, every=1)


def test_the_operator_was_never_refused_by_the_apiserver(cluster: Cluster) -> None:
    """Every step above ran under the chart's RBAC; a 403 anywhere means a rule is missing."""
    refused = [
        line
        for log in cluster.operator.logs
        for line in log.read_text(errors="replace").splitlines()
        if "forbidden" in line.lower() or "HTTP 403" in line
    ]
    assert refused == []


def test_the_token_is_in_no_log_status_event_or_config_map(cluster: Cluster) -> None:
    """Only Secrets hold it: every pool rendered above, the operator's logs, the events it
    posted and every status it wrote were made with it configured."""
    token = cluster.sidecar_token
    encoded = base64.b64encode(token.encode()).decode()
    for log in cluster.operator.logs:
        assert token not in log.read_text(errors="replace"), log.name
    kinds = "modelpools,events,configmaps,statefulsets,services,poddisruptionbudgets"
    stored = json.loads(cluster.admin.ok("get", kinds, "-A", "-o", "json"))["items"]
    assert any(o["kind"] == "StatefulSet" for o in stored)
    for obj in stored:
        text = json.dumps(obj)
        assert token not in text and encoded not in text, (obj["kind"], obj["metadata"]["name"])


def test_helm_uninstall_removes_every_object_of_the_chart(cluster: Cluster) -> None:
    manifest = cluster.admin.helm("get", "manifest", RELEASE, "-n", SYSTEM)
    assert manifest.returncode == 0, manifest.stderr
    chart_objects = [d for d in yaml.safe_load_all(manifest.stdout) if d]
    assert len(chart_objects) >= 9
    cluster.operator.stop()
    out = cluster.admin.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout", "60s")
    assert out.returncode == 0, out.stderr

    def gone(doc: dict[str, Any]) -> bool:
        meta = doc["metadata"]
        return cluster.admin.get(doc["kind"], meta["name"], meta.get("namespace")) is None

    left = [f"{d['kind']}/{d['metadata']['name']}" for d in chart_objects if not gone(d)]
    assert left == []
    listed = cluster.admin.helm("list", "-n", SYSTEM, "-q")
    assert listed.stdout.strip() == ""
    # crds/ is Helm's install-only folder: the CRDs, and so every user's ModelPools, stay.
    for crd in CRDS:
        assert cluster.admin.get("crd", crd) is not None
    assert "llama-8b" in cluster.admin.ok("get", "modelpools", "-A", "-o", "name")
