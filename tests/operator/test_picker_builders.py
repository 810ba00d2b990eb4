"""`spec.routing.picker: kvbank`: the InferencePool, the picker's Deployment, Service, RBAC and
NetworkPolicies, exact where it matters; reconcile's Routing condition with the InferencePool
API served or not; and a pool switched back to `picker: none` losing them, and nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, pool_doc, stored
from pod_security import violations

from kvbank.capacity import holdability
from kvbank.deployment import parse_deployment
from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.reconcile import reconcile, repair
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import (
    LABEL_POOL,
    Owner,
    RenderSettings,
    Workload,
    selector_labels,
)
from kvbank.operator.render.picker import (
    INFERENCE_API_VERSION,
    PICKER_OBJECTS,
    PICKER_PORT,
    picker_selector,
    render_picker,
)
from kvbank.operator.render.sidecar_tls import PoolTLS

OWNER = Owner("llama", "team-a", "uid-7")
SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken-for-tests")
ROUTED = {"routing": {"picker": "kvbank"}}


def _render(tls: PoolTLS | None = None, kind: Workload = Workload.STATEFUL_SET, **spec: Any):
    doc = pool_doc(**{**ROUTED, **spec})
    pool, deployment = parse_modelpool(doc), parse_deployment(doc)
    objs = render_picker(pool, OWNER, SETTINGS, kind, deployment, "f" * 64, "llama-tok", tls)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_picker_none_or_absent_renders_nothing_more_and_a_wrong_value_is_refused() -> None:
    for spec in ({}, {"routing": {"picker": "none"}}, {"routing": {}}):
        doc = pool_doc(**spec)
        pool, deployment = parse_modelpool(doc), parse_deployment(doc)
        assert deployment.picker == "none"
        assert render_picker(pool, OWNER, SETTINGS, Workload.STATEFUL_SET, deployment, "f" * 64,
                             "tok", None) == []  # fmt: skip
        rendered = render_pool(pool, holdability(pool), OWNER, doc["spec"], SETTINGS,
                               Workload.STATEFUL_SET, deployment)  # fmt: skip
        assert {m["kind"] for m in rendered.manifests} == {
            "ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"}  # fmt: skip
    for bad, says in [({"picker": "llm-d"}, "spec.routing.picker"), ({"pickr": "kvbank"}, "pickr")]:
        with pytest.raises(SpecError, match=says):
            parse_deployment(pool_doc(routing=bad))


def test_the_inference_pool_selects_rank_0_on_the_engine_port_and_names_the_picker() -> None:
    ip = _render()[("InferencePool", "llama")]
    assert ip["apiVersion"] == "inference.networking.k8s.io/v1"
    assert ip["spec"] == {
        "selector": {"matchLabels": selector_labels("llama")},  # one pod per group: every pod
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "llama-picker",
                              "port": {"number": PICKER_PORT}, "failureMode": "FailClose"},
    }  # fmt: skip
    lws = _render(kind=Workload.LEADER_WORKER_SET)[("InferencePool", "llama")]
    assert lws["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_every_object_is_owned_by_the_pool_and_the_picker_pods_are_not_rank_pods() -> None:
    objs = _render()
    assert sorted(objs) == [
        ("Deployment", "llama-picker"), ("InferencePool", "llama"),
        ("NetworkPolicy", "llama-picker"), ("NetworkPolicy", "llama-picker-to-sidecars"),
        ("Role", "llama-picker"), ("RoleBinding", "llama-picker"), ("Service", "llama-picker"),
        ("ServiceAccount", "llama-picker"),
    ]  # fmt: skip
    for obj in objs.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("ModelPool", "uid-7", True)
        assert obj["metadata"]["namespace"] == "team-a"
    pod_labels = objs[("Deployment", "llama-picker")]["spec"]["template"]["metadata"]["labels"]
    rank = selector_labels("llama")
    assert not all(pod_labels.get(k) == v for k, v in rank.items())  # no rank selector matches


def test_the_deployment_is_two_hardened_replicas_probed_on_the_grpc_health_services() -> None:
    dep = _render(tls=PoolTLS("llama-sidecar-tls", "abc"))[("Deployment", "llama-picker")]
    spec = dep["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"] == picker_selector("llama")
    template = spec["template"]
    assert violations(template) == []  # Pod Security restricted
    pod = template["spec"]
    assert pod["serviceAccountName"] == "llama-picker"
    (picker,) = pod["containers"]
    assert picker["resources"]["requests"] and picker["resources"]["limits"]["memory"]
    assert picker["readinessProbe"]["grpc"] == {"port": PICKER_PORT, "service": "readiness"}
    assert picker["livenessProbe"]["grpc"] == {"port": PICKER_PORT, "service": "liveness"}
    assert picker["startupProbe"]["grpc"]["service"] == "liveness"
    args = picker["args"]
    assert args[:2] == ["kvbank", "picker"]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert flag("--selector") == "app.kubernetes.io/name=kvbank,kvbank.dev/pool=llama"
    assert (flag("--namespace"), flag("--target-port"), flag("--sidecar-port")) == (
        "team-a", "8000", "50051")  # fmt: skip
    assert flag("--pool") == "/etc/kvbank/config/modelpool.yaml"
    assert flag("--model-dir") == "/models/llama-3.1-8b-instruct"
    assert flag("--sidecar-ca-file") == "/etc/kvbank/sidecar-tls/ca.crt"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "llama-engine-ffffffffff"
    ca_only = {"secretName": "llama-sidecar-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes["sidecar-tls"]["secret"] == ca_only  # never the sidecars' key
    no_tls = _render()[("Deployment", "llama-picker")]["spec"]["template"]["spec"]
    assert "--sidecar-ca-file" not in no_tls["containers"][0]["args"]


def test_the_picker_reaches_pods_weights_as_the_engine_does() -> None:
    source = {"source": {"pvc": {"claimName": "weights"}}}
    model = {"name": "llama-3.1-8b-instruct", "architecture": {"preset": "llama-3.1-8b"}, **source}
    pod = _render(model=model)[("Deployment", "llama-picker")]["spec"]["template"]["spec"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [c["persistentVolumeClaim"]["claimName"] for c in claims] == ["weights"]
    assert violations({"spec": pod}) == []


def test_rbac_reads_pods_in_the_pool_namespace_only() -> None:
    objs = _render()
    role = objs[("Role", "llama-picker")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    binding = objs[("RoleBinding", "llama-picker")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "llama-picker"}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-picker",
                                    "namespace": "team-a"}]  # fmt: skip


def test_network_policies_let_the_gateway_in_and_the_picker_reach_the_sidecars() -> None:
    objs = _render()
    own = objs[("NetworkPolicy", "llama-picker")]["spec"]
    assert own["podSelector"]["matchLabels"] == picker_selector("llama")
    assert {p["port"] for p in own["ingress"][0]["ports"]} == {PICKER_PORT, 9090}
    to_sidecars = own["egress"][0]
    assert to_sidecars["to"] == [{"podSelector": {"matchLabels": selector_labels("llama")}}]
    assert to_sidecars["ports"] == [{"port": 50051, "protocol": "TCP"}]
    ranks = objs[("NetworkPolicy", "llama-picker-to-sidecars")]["spec"]
    assert ranks["podSelector"]["matchLabels"] == selector_labels("llama")
    pickers = {"podSelector": {"matchLabels": picker_selector("llama")}}
    assert ranks["ingress"] == [{"from": [pickers], "ports": [{"port": 50051, "protocol": "TCP"}]}]
    service = objs[("Service", "llama-picker")]["spec"]
    assert service["selector"] == picker_selector("llama")
    assert service["ports"][0]["port"] == PICKER_PORT


def _reconcile(apis: tuple[str, ...]) -> tuple[FakeCluster, dict[str, Any]]:
    cluster = FakeCluster(apis=apis)
    cluster.put(namespace_doc("team-a"))
    cluster.put(stored(pool_doc(**ROUTED)))
    doc = cluster.one("ModelPool", "llama")
    outcome = asyncio.run(reconcile(cluster, SETTINGS, doc, now="2026-01-01T00:00:00Z"))
    assert outcome.accepted, outcome.message
    status = cluster.one("ModelPool", "llama")["status"]
    (routing,) = [c for c in status["conditions"] if c["type"] == "Routing"]
    return cluster, routing


def test_reconcile_applies_the_picker_and_the_inference_pool_when_the_api_is_served() -> None:
    cluster, routing = _reconcile((INFERENCE_API_VERSION,))
    assert (routing["status"], routing["reason"]) == ("True", "InferencePoolRendered")
    assert [o["metadata"]["name"] for o in cluster.kinds("InferencePool")] == ["llama"]
    assert [o["metadata"]["name"] for o in cluster.kinds("Deployment")] == ["llama-picker"]


def test_without_the_inference_pool_crd_the_pool_says_so_and_the_picker_still_runs() -> None:
    cluster, routing = _reconcile(())
    assert (routing["status"], routing["reason"]) == ("False", "InferencePoolCRDMissing")
    assert "install the Gateway API Inference Extension's CRDs" in routing["message"]
    assert cluster.kinds("InferencePool") == []
    assert [o["metadata"]["name"] for o in cluster.kinds("Deployment")] == ["llama-picker"]
    # The CRD arrives: the next pass applies the InferencePool and the condition turns True.
    cluster.apis.add(INFERENCE_API_VERSION)
    doc = cluster.one("ModelPool", "llama")
    asyncio.run(reconcile(cluster, SETTINGS, doc, now="2026-01-01T00:01:00Z"))
    assert len(cluster.kinds("InferencePool")) == 1


def test_the_repair_timer_puts_back_a_picker_object_that_vanished() -> None:
    cluster, _ = _reconcile((INFERENCE_API_VERSION,))
    del cluster.objects[("apps/v1", "Deployment", "team-a", "llama-picker")]
    del cluster.objects[(INFERENCE_API_VERSION, "InferencePool", "team-a", "llama")]
    doc = cluster.one("ModelPool", "llama")
    outcome = asyncio.run(repair(cluster, SETTINGS, doc, now="2026-01-01T00:01:00Z"))
    assert outcome is not None
    assert sorted(outcome.applied) == ["Deployment/llama-picker (missing)",
                                       "InferencePool/llama (missing)"]  # fmt: skip


def test_every_picker_object_carries_the_labels_its_removal_selects_on() -> None:
    found = set()
    for (kind, _), obj in _render().items():
        labels = obj["metadata"]["labels"]
        assert labels[LABEL_POOL] == "llama", kind
        found.add((obj["apiVersion"], kind, labels["app.kubernetes.io/component"]))
    assert found == set(PICKER_OBJECTS)
    assert PICKER_OBJECTS[0][1] == "InferencePool"  # deleted first: nothing routes to the rest


def _switch_to_none(cluster: FakeCluster, routing: dict[str, Any] | None) -> dict[str, Any]:
    doc = cluster.one("ModelPool", "llama")
    doc["spec"].pop("routing")
    if routing is not None:
        doc["spec"]["routing"] = routing
    doc["metadata"]["generation"] += 1
    cluster.put(doc)
    outcome = asyncio.run(reconcile(cluster, SETTINGS, doc, now="2026-01-01T00:02:00Z"))
    assert outcome.accepted, outcome.message
    return cluster.one("ModelPool", "llama")


def _names(cluster: FakeCluster, kind: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in cluster.kinds(kind))


@pytest.mark.parametrize("routing", [{"picker": "none"}, {}, None])
def test_switching_back_to_none_removes_what_the_pool_owns_of_the_picker(
    routing: dict[str, Any] | None,
) -> None:
    cluster, _ = _reconcile((INFERENCE_API_VERSION,))
    picker = cluster.one("Service", "llama-picker")
    # The picker's labels on objects this pool does not own: someone else's, never deleted.
    for name, refs in (("mine", []), ("theirs", [{**picker["metadata"]["ownerReferences"][0],
                                                  "uid": "uid-other"}])):  # fmt: skip
        cluster.put({**picker, "metadata": {**picker["metadata"], "name": name, "uid": name,
                                            "ownerReferences": refs}})  # fmt: skip
    status = _switch_to_none(cluster, routing)
    for kind in ("InferencePool", "Deployment", "NetworkPolicy", "Role", "RoleBinding",
                 "ServiceAccount"):  # fmt: skip
        assert cluster.kinds(kind) == [], kind
    assert _names(cluster, "Service") == ["llama", "llama-ranks", "mine", "theirs"]
    assert _names(cluster, "StatefulSet") == ["llama"]
    assert [c["type"] for c in status["status"]["conditions"] if c["type"] == "Routing"] == []
    # The InferencePool first, so that nothing routes to a picker being removed; the spec
    # change's old ConfigMap is pruned as at any roll.
    deleted = [what for verb, what in cluster.calls if verb == "delete"]
    assert [what for what in deleted if not what.startswith("ConfigMap/")] == [
        "InferencePool/llama", "Deployment/llama-picker", "Service/llama-picker",
        "NetworkPolicy/llama-picker", "NetworkPolicy/llama-picker-to-sidecars",
        "RoleBinding/llama-picker", "Role/llama-picker", "ServiceAccount/llama-picker",
    ]  # fmt: skip


def test_without_the_inference_pool_api_the_switch_back_does_not_look_for_one() -> None:
    cluster, _ = _reconcile(())
    cluster.calls.clear()
    _switch_to_none(cluster, {"picker": "none"})
    assert ("list", "InferencePool") not in cluster.calls
    assert ("list", "Deployment") in cluster.calls
    assert cluster.kinds("Deployment") == [] and cluster.kinds("ServiceAccount") == []


def test_the_repair_timer_of_a_pool_without_a_picker_lists_no_picker_kind() -> None:
    cluster, _ = _reconcile((INFERENCE_API_VERSION,))
    _switch_to_none(cluster, {"picker": "none"})
    cluster.calls.clear()
    outcome = asyncio.run(repair(cluster, SETTINGS, cluster.one("ModelPool", "llama"),
                                 now="2026-01-01T00:03:00Z"))  # fmt: skip
    assert outcome is not None and outcome.applied == ()
    kinds = {what for verb, what in cluster.calls if verb == "list"}
    assert not kinds & {kind for _, kind, _ in PICKER_OBJECTS}, kinds


def test_the_rendered_command_line_is_one_kvbank_picker_reads() -> None:
    import argparse

    from kvbank.picker import server

    dep = _render(tls=PoolTLS("llama-sidecar-tls", "abc"))[("Deployment", "llama-picker")]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    server.add_arguments(parser)
    parsed = parser.parse_args(args[2:])
    assert (parsed.selector, parsed.namespace, parsed.pod) == (
        "app.kubernetes.io/name=kvbank,kvbank.dev/pool=llama", "team-a", [])  # fmt: skip
    assert parsed.listen == f"0.0.0.0:{PICKER_PORT}"
