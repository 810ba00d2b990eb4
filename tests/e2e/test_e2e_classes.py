"""ModelPool `spec.admission`'s service classes and `spec.kv.hostPages` against a real
kube-apiserver: `kubectl apply` with the chart's CRD and the operator's webhook. The CRD fills
the defaults and refuses what its schema can say, the webhook refuses what only it can (a vllm
pool asking for what vLLM would not carry out), and the operator renders what was admitted into
the engine's command."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_kube import FIRST_USE_TIMEOUT, example, wait_for
from test_cluster import Cluster, cluster

__all__ = ["cluster"]  # the fixture, shared with test_cluster: its own control plane here
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(FIRST_USE_TIMEOUT)]

POOL = "llama-8b"


def pool_with(ns: str, engine: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    doc = example("modelpool-llama-8b.yaml", ns)
    for key, value in sections.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    if engine is not None:
        doc["spec"]["engine"] = engine
    return doc


def engine_args(cluster: Cluster, ns: str) -> list[str]:
    def rendered() -> list[dict[str, Any]] | None:
        return cluster.admin.items("statefulsets", ns, f"kvbank.dev/pool={POOL}") or None

    [sts] = wait_for("the pool's StatefulSet", rendered, 60)
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    args: list[str] = engine["args"]
    return args


def test_an_existing_pools_admission_gains_the_strict_default_and_renders_no_class_flag(
    cluster: Cluster,
) -> None:
    ns = cluster.namespace("classes-plain")
    out = cluster.admin.apply(pool_with(ns))
    assert out.returncode == 0, out.stderr
    stored = cluster.pool(ns, POOL)
    assert stored is not None
    assert stored["spec"]["admission"]["defaultClass"] == "strict"  # the CRD's default
    assert "bestEffort" not in stored["spec"]["admission"]
    cluster.accepted(ns, POOL)
    args = engine_args(cluster, ns)
    assert not {"--default-class", "--max-preemptions", "--victim", "--host-pages"} & set(args)


def test_a_best_effort_pool_is_admitted_with_defaults_and_rendered(cluster: Cluster) -> None:
    ns = cluster.namespace("classes-flex")
    doc = pool_with(ns, admission={"defaultClass": "best-effort", "bestEffort": {"victim":
                    "cheapest"}}, kv={"hostPages": 4096})  # fmt: skip
    out = cluster.admin.apply(doc)
    assert out.returncode == 0, out.stderr
    stored = cluster.pool(ns, POOL)
    assert stored is not None
    best = stored["spec"]["admission"]["bestEffort"]
    assert best == {"maxPreemptions": 2, "victim": "cheapest", "estimate": "learned"}
    cluster.accepted(ns, POOL)
    args = engine_args(cluster, ns)
    assert args[args.index("--host-pages") :][:6] == [
        "--host-pages", "4096", "--default-class", "best-effort", "--victim", "cheapest",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("admission", "said"),
    [
        ({"defaultClass": "flex"}, 'spec.admission.defaultClass: Unsupported value: "flex"'),
        ({"bestEffort": {"maxPreemptions": 65}}, "spec.admission.bestEffort.maxPreemptions"),
        ({"bestEffort": {"victim": "oldest"}}, 'Unsupported value: "oldest"'),
    ],
)
def test_the_crd_refuses_a_bad_class_field_by_name(
    cluster: Cluster, admission: dict[str, Any], said: str
) -> None:
    ns = cluster.namespace("classes-bad")
    out = cluster.admin.apply(pool_with(ns, admission=admission))
    assert out.returncode != 0
    assert said in out.stderr
    assert cluster.pool(ns, POOL) is None


def test_the_webhook_refuses_a_host_tier_and_a_victim_rule_under_vllm(cluster: Cluster) -> None:
    ns = cluster.namespace("classes-vllm")
    doc = pool_with(ns, {"kind": "vllm"}, kv={"hostPages": 8},
                    admission={"defaultClass": "best-effort",
                               "bestEffort": {"victim": "cheapest"}})  # fmt: skip
    out = cluster.admin.apply(doc)
    assert out.returncode != 0
    assert "admission webhook" in out.stderr
    assert "spec.kv.hostPages: is 8, but spec.engine.kind vllm has no host tier" in out.stderr
    assert "spec.admission.bestEffort: sets victim, but under spec.engine.kind vllm" in (out.stderr)
    assert "defaultClass" not in out.stderr  # vLLM's scheduler class runs both classes
    assert cluster.pool(ns, POOL) is None
    fixed = pool_with(ns, {"kind": "vllm"}, kv={"hostPages": 0},
                      admission={"defaultClass": "best-effort"})  # fmt: skip
    out = cluster.admin.apply(fixed)
    assert out.returncode == 0, out.stderr


def test_the_estimate_reaches_the_engine(cluster: Cluster) -> None:
    ns = cluster.namespace("classes-estimate")
    out = cluster.admin.apply(pool_with(ns, admission={"bestEffort": {"estimate": "ratio"}}))
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr
    cluster.accepted(ns, POOL)
    args = engine_args(cluster, ns)
    assert args[args.index("--estimate") + 1] == "ratio"
