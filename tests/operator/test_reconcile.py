"""Reconcile against the in-memory cluster: it renders, applies idempotently, re-judges what
slipped past the webhook, keeps a pool's workload kind, and converges after a restart
mid-way without creating anything twice."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, policy_doc, pool_doc, stored

from kvbank.operator.cluster import KubeUnavailable
from kvbank.operator.live import refresh
from kvbank.operator.reconcile import reconcile
from kvbank.operator.render.names import ANNOTATION_CONFIG_HASH, RenderSettings

TOKEN = "t0ken-for-tests"
SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token=TOKEN)
OWNED = ["ConfigMap", "PodDisruptionBudget", "Secret", "Service", "Service", "StatefulSet"]


class NoSidecar:
    async def status(self, address: str, timeout: float, server_name: str | None = None) -> Any:
        raise ConnectionError("none")


def _setup(*docs: dict[str, Any], apis: tuple[str, ...] = ()) -> FakeCluster:
    cluster = FakeCluster(apis=apis)
    cluster.put(namespace_doc("team-a"))
    for doc in docs:
        cluster.put(doc)
    return cluster


def _run(cluster: FakeCluster, name: str = "llama", settings: RenderSettings = SETTINGS):
    doc = cluster.one("ModelPool", name)
    return asyncio.run(reconcile(cluster, settings, doc, now="2026-01-01T00:00:00Z"))


def _owned(cluster: FakeCluster) -> list[dict[str, Any]]:
    return [
        o
        for o in cluster.objects.values()
        if any(r.get("kind") == "ModelPool" for r in o["metadata"].get("ownerReferences", []))
    ]


def _condition(cluster: FakeCluster, kind: str, name: str = "llama") -> dict[str, Any]:
    status = cluster.one("ModelPool", name).get("status") or {}
    (found,) = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found


class TestAccepted:
    def test_renders_every_object_owned_by_the_pool(self) -> None:
        cluster = _setup(stored(pool_doc()))
        outcome = _run(cluster)
        assert outcome.accepted
        config_hash = cluster.one("ModelPool", "llama")["status"]["configHash"]
        (secret,) = cluster.kinds("Secret")
        assert outcome.applied == (
            f"Secret/{secret['metadata']['name']}",
            f"ConfigMap/llama-engine-{config_hash[:10]}",
            "Service/llama-ranks",
            "Service/llama",
            "PodDisruptionBudget/llama",
            "StatefulSet/llama",
        )
        owned = _owned(cluster)
        assert sorted(o["kind"] for o in owned) == OWNED
        uid = cluster.one("ModelPool", "llama")["metadata"]["uid"]
        assert all(o["metadata"]["ownerReferences"][0]["uid"] == uid for o in owned)

    def test_status_carries_the_figures_and_accepted(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        status = cluster.one("ModelPool", "llama")["status"]
        assert {k: status[k] for k in ("observedGeneration", "pages", "worstRequestPages")} == {
            "observedGeneration": 1,
            "pages": 20000,
            "worstRequestPages": 513,
        }
        assert status["worstConcurrency"] == 38 and status["workload"] == "StatefulSet"
        accepted = _condition(cluster, "Accepted")
        assert accepted["status"] == "True" and accepted["reason"] == "Holdable"
        assert accepted["message"] == (
            "worst-case request 513 pages; the pool (20000 pages) holds 38 worst-case "
            "requests at once"
        )

    def test_twice_changes_nothing(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        before = copy.deepcopy(cluster.objects)
        _run(cluster)
        assert cluster.objects == before

    def test_a_spec_change_rolls_the_pods(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        first = cluster.one("StatefulSet", "llama")["spec"]["template"]["metadata"]["annotations"]
        pool = cluster.one("ModelPool", "llama")
        pool["spec"]["limits"] = {"maxSeqLen": 4096, "maxTokens": 1024}
        pool["metadata"]["generation"] = 2
        _run(cluster)
        second = cluster.one("StatefulSet", "llama")["spec"]["template"]["metadata"]["annotations"]
        assert first[ANNOTATION_CONFIG_HASH] != second[ANNOTATION_CONFIG_HASH]
        assert cluster.one("ModelPool", "llama")["status"]["observedGeneration"] == 2
        (config,) = cluster.kinds("ConfigMap")  # the old one: no pod mounts it, so it went
        assert config["metadata"]["name"] == f"llama-engine-{second[ANNOTATION_CONFIG_HASH][:10]}"
        assert '"maxSeqLen": 4096' in config["data"]["engine.json"]

    def test_an_old_config_stays_while_a_pod_mounts_it(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        old_config = cluster.kinds("ConfigMap")[0]["metadata"]["name"]
        template = cluster.one("StatefulSet", "llama")["spec"]["template"]
        cluster.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "llama-0", "namespace": "team-a", **template["metadata"]},
                "spec": template["spec"],
            }
        )
        pool = cluster.one("ModelPool", "llama")
        pool["spec"]["kv"]["pages"] = 10000
        _run(cluster)
        names = sorted(c["metadata"]["name"] for c in cluster.kinds("ConfigMap"))
        assert len(names) == 2 and old_config in names
        del cluster.objects[("v1", "Pod", "team-a", "llama-0")]  # the roll replaced it
        doc = cluster.one("ModelPool", "llama")
        asyncio.run(refresh(cluster, NoSidecar(), doc, port=1, concurrency=1, timeout=0.1, now="t"))
        (left,) = cluster.kinds("ConfigMap")
        assert left["metadata"]["name"] != old_config

    def test_leader_worker_set_where_its_api_is_served(self) -> None:
        cluster = _setup(stored(pool_doc(tensorParallel=2)), apis=("leaderworkerset.x-k8s.io/v1",))
        _run(cluster)
        lws = cluster.one("LeaderWorkerSet", "llama")
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert cluster.kinds("StatefulSet") == []
        assert cluster.one("ModelPool", "llama")["status"]["workload"] == "LeaderWorkerSet"

    def test_a_pool_keeps_its_workload_kind_when_leader_worker_set_appears(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        cluster.apis.add("leaderworkerset.x-k8s.io/v1")
        _run(cluster)
        assert cluster.kinds("LeaderWorkerSet") == []
        assert len(cluster.kinds("StatefulSet")) == 1


class TestSidecarToken:
    def test_the_secret_is_created_once_and_mounted_by_name(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        _run(cluster)
        (secret,) = cluster.kinds("Secret")
        name = secret["metadata"]["name"]
        assert [c for c in cluster.calls if c[1] == f"Secret/{name}"] == [
            ("create", f"Secret/{name}"),
            ("create", f"Secret/{name}"),  # the second finds it: nothing changes
        ]
        assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
        template = cluster.one("StatefulSet", "llama")["spec"]["template"]
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["sidecar-token"]["secret"]["secretName"] == name

    def test_a_new_token_rolls_the_pods_onto_a_new_secret(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        first = cluster.one("StatefulSet", "llama")["spec"]["template"]
        config_hash = cluster.one("ModelPool", "llama")["status"]["configHash"]
        _run(cluster, settings=dataclasses.replace(SETTINGS, sidecar_token="rotated"))
        second = cluster.one("StatefulSet", "llama")["spec"]["template"]
        assert first["spec"]["volumes"] != second["spec"]["volumes"]  # so the pods roll
        # The config did not change; the old Secret stays for the pods still running on it.
        assert cluster.one("ModelPool", "llama")["status"]["configHash"] == config_hash
        assert len(cluster.kinds("Secret")) == 2

    def test_without_a_token_nothing_is_rendered_and_the_pool_says_how_to_set_it(self) -> None:
        cluster = _setup(stored(pool_doc()))
        outcome = _run(cluster, settings=RenderSettings())
        assert not outcome.accepted
        assert _owned(cluster) == []
        for kind in ("Accepted", "Ready"):
            cond = _condition(cluster, kind)
            assert (cond["status"], cond["reason"]) == ("False", "SidecarTokenMissing")
            assert "set KVBANK_SIDECAR_TOKEN or --sidecar-token" in cond["message"]
        assert outcome.message == _condition(cluster, "Accepted")["message"]
        # Restarted with a token, the operator renders the pool.
        assert _run(cluster).accepted
        assert _condition(cluster, "Ready")["reason"] == "SidecarTokenMissing"  # until live runs
        assert sorted(o["kind"] for o in _owned(cluster)) == OWNED

    def test_the_token_is_in_the_secret_and_nowhere_else(self) -> None:
        cluster = _setup(stored(pool_doc()))
        outcome = _run(cluster)
        secret_key = next(k for k in cluster.objects if k[1] == "Secret")
        encoded = base64.b64encode(TOKEN.encode()).decode()
        for key, obj in cluster.objects.items():
            if key == secret_key:
                continue
            text = json.dumps(obj)
            assert TOKEN not in text and encoded not in text, key
        assert TOKEN not in repr(outcome) and TOKEN not in repr(SETTINGS)


class TestRefused:
    def test_an_unholdable_spec_that_slipped_past_renders_nothing(self) -> None:
        cluster = _setup(stored(pool_doc(kv={"pageSize": 16, "pages": 400})))
        outcome = _run(cluster)
        assert not outcome.accepted
        assert _owned(cluster) == []
        accepted = _condition(cluster, "Accepted")
        assert accepted["status"] == "False" and accepted["reason"] == "Unholdable"
        assert "kv.pages=400 cannot hold one worst-case request" in accepted["message"]

    def test_groups_of_several_pods_without_leader_worker_set_render_nothing(self) -> None:
        """The traffic Service could not pick each group's rank 0 out of one StatefulSet by a
        label its controller stamps; the operator labels no pods."""
        cluster = _setup(stored(pool_doc(replicas=2, tensorParallel=2)))
        outcome = _run(cluster)
        assert not outcome.accepted
        assert _owned(cluster) == []
        accepted = _condition(cluster, "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", "NeedsLeaderWorkerSet")
        assert accepted["message"].startswith(
            "team-a/llama: no pods rendered: spec.replicas=2 with spec.tensorParallel=2 runs 2 "
            "groups of 2 pods, which needs a LeaderWorkerSet"
        )
        cluster.one("ModelPool", "llama")["spec"]["replicas"] = 1
        assert _run(cluster).accepted
        service = cluster.one("Service", "llama")
        assert service["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"

    def test_a_later_bad_spec_leaves_the_running_objects_alone(self) -> None:
        cluster = _setup(stored(pool_doc()))
        _run(cluster)
        before = {k: v for k, v in cluster.objects.items() if k[1] != "ModelPool"}
        cluster.one("ModelPool", "llama")["spec"]["kv"]["pages"] = 400
        assert not _run(cluster).accepted
        assert {k: v for k, v in cluster.objects.items() if k[1] != "ModelPool"} == before

    def test_two_pools_racing_a_quota_end_with_the_later_refused(self) -> None:
        cluster = _setup(
            policy_doc("quota", {"gpusPerNamespace": 4}, {}),
            stored(pool_doc("first", replicas=3), uid="u1", created="2026-01-01T00:00:01Z"),
            stored(pool_doc("second", replicas=3), uid="u2", created="2026-01-01T00:00:02Z"),
        )
        assert not _run(cluster, "second").accepted  # the later one reconciles first
        assert _run(cluster, "first").accepted
        assert not _run(cluster, "second").accepted
        refused = _condition(cluster, "Accepted", "second")
        assert refused["reason"] == "OverPolicy"
        assert "would use 6 GPUs (first 3, second 3" in refused["message"]
        assert [s["metadata"]["name"] for s in cluster.kinds("StatefulSet")] == ["first"]

    def test_a_name_too_long_for_its_children(self) -> None:
        name = "n" * 41
        cluster = _setup(stored(pool_doc(name)))
        outcome = _run(cluster, name)
        assert not outcome.accepted
        # the schema's own rule (kvbank.modelpool), so kvbank check refuses it too
        assert "metadata.name: has 41 characters; at most 40" in outcome.message
        assert _condition(cluster, "Accepted", name)["reason"] == "InvalidSpec"


class TestRestart:
    @pytest.mark.parametrize("dies_after", [3, 4, 5, 7, 9])
    def test_killed_mid_reconcile_converges_with_nothing_twice(self, dies_after: int) -> None:
        reference = _setup(stored(pool_doc()))
        _run(reference)
        cluster = _setup(stored(pool_doc()))
        cluster.fail_after = dies_after
        with pytest.raises(KubeUnavailable):
            _run(cluster)
        cluster.fail_after = None
        _run(cluster)  # the restarted operator resumes the pool
        assert sorted(o["kind"] for o in _owned(cluster)) == OWNED
        strip = lambda objs: {  # noqa: E731
            k: {**v, "metadata": {**v["metadata"], "resourceVersion": None}}
            for k, v in objs.items()
        }
        assert strip(cluster.objects) == strip(reference.objects)


def _without_versions(objects: dict) -> dict:
    return {
        key: {**obj, "metadata": {**obj["metadata"], "resourceVersion": None}}
        for key, obj in objects.items()
    }


def _reconcile_until_done(cluster: FakeCluster, spec: dict[str, Any], crash_after: int) -> None:
    """Write the spec, then reconcile with the API failing after `crash_after` calls, and
    again (the restarted operator) with it healthy."""
    pool = cluster.one("ModelPool", "llama")
    if pool["spec"] != spec:
        pool["spec"] = copy.deepcopy(spec)
        pool["metadata"]["generation"] += 1
    cluster.fail_after = crash_after
    with contextlib.suppress(KubeUnavailable):
        _run(cluster)
    cluster.fail_after = None
    _run(cluster)


SPECS = st.builds(
    lambda replicas, tp, pages, seq: pool_doc(
        replicas=replicas,
        tensorParallel=tp,
        kv={"pageSize": 16, "pages": pages, "speculativeTokens": 1},
        limits={"maxSeqLen": seq, "maxTokens": seq // 4},
    )["spec"],
    st.integers(0, 3),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([300, 5000, 20000]),  # 300 pages cannot hold an 8k request: refused
    st.sampled_from([2048, 8192]),
)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(SPECS, st.integers(0, 14)), min_size=1, max_size=3))
def test_any_crash_point_in_any_update_sequence_converges(steps) -> None:
    """Crashing anywhere in any reconcile of a sequence of updates ends in exactly the state an
    operator that never crashed reaches: the same objects, none twice."""
    first_spec = steps[0][0]
    reference = _setup(stored({**pool_doc(), "spec": first_spec}))
    crashed = _setup(stored({**pool_doc(), "spec": first_spec}))
    for spec, crash_after in steps:
        _reconcile_until_done(reference, spec, crash_after=10_000)
        _reconcile_until_done(crashed, spec, crash_after)
    assert _without_versions(crashed.objects) == _without_versions(reference.objects)
