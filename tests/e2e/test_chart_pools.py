"""`helm template` with the example pool (examples/values-llama-8b.yaml): the chart installs the
pool and its weights claim, hands its pools.template to the operator, scrapes the engine and the
sidecar, and ships a dashboard of metrics the code exports. The operator's own builders then
render the pool the chart installed, as they would in the cluster, so the weights volume and
the scheduling fields are checked on the StatefulSet too. No cluster is needed."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from e2e_kube import CHART, ROOT, Tools
from e2e_kube import example as load_example
from test_chart import by_kind, env_of, helm, one, parsed_operator_config, render

from kvbank.capacity import holdability
from kvbank.check import load_documents
from kvbank.deployment import parse_deployment
from kvbank.modelpool import parse_modelpool
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import Owner, Workload

__all__ = ["helm"]  # the fixture, shared with test_chart
VALUES = ROOT / "examples" / "values-llama-8b.yaml"
MONITORING = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
# Names the dashboard reads that the engine gains with its own metrics work (TPOT, preemptions)
# and the Gateway API Inference Extension's; every other name must be exported by the code.
PENDING_METRICS = {
    "kvbank_time_per_output_token_seconds",
    "kvbank_preemptions",
    "vllm:kv_cache_usage_perc",
}
METRIC_SOURCES = (
    ROOT / "engine" / "serve" / "http" / "metrics.py",
    ROOT / "sidecar" / "metrics.py",
)


def with_example(helm: Tools, *sets: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = render(helm, *sets, extra=("-f", str(VALUES), *MONITORING))
    return docs


def test_the_example_values_install_the_example_pool_and_its_weights_claim(helm: Tools) -> None:
    docs = with_example(helm)
    pool_doc = one(docs, "ModelPool")
    example = load_example("modelpool-llama-8b.yaml")
    # The same pool as examples/modelpool-llama-8b.yaml, field for field as the operator reads it.
    assert parse_modelpool(pool_doc) == parse_modelpool(example)
    assert parse_deployment(pool_doc) == parse_deployment(example)
    claim = one(docs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == pool_doc["spec"]["model"]["source"]["pvc"]["claimName"]
    assert claim["metadata"]["namespace"] == pool_doc["metadata"]["namespace"] == "team-a"
    # Writable, for the loader pod that fills it (ReadOnlyMany could never be filled).
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"] == {"requests": {"storage": "40Gi"}}
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def rendered_pod(helm: Tools, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The rank pod the operator renders for the chart's pool, with the chart's settings."""
    docs = with_example(helm)
    config = parsed_operator_config(env_of(one(docs, "Deployment")), monkeypatch)
    settings = dataclasses.replace(config.render, sidecar_token="t0ken")
    pool_doc = one(docs, "ModelPool")
    pool = parse_modelpool(pool_doc)
    rendered = render_pool(
        pool,
        holdability(pool),
        Owner(pool.name, pool.namespace, "uid-1"),
        pool_doc["spec"],
        settings,
        Workload.STATEFUL_SET,
        parse_deployment(pool_doc),
    )
    template: dict[str, Any] = rendered.manifests[-1]["spec"]["template"]
    return template["spec"]


def test_the_operator_mounts_the_weights_where_the_engine_looks(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = rendered_pod(helm, monkeypatch)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"] == {
        "name": "weights",
        "persistentVolumeClaim": {"claimName": "llama-3-1-8b-weights", "readOnly": True},
    }
    engine = pod["containers"][0]
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "weights")
    assert mount == {
        "name": "weights",
        "mountPath": "/models/llama-3.1-8b-instruct",
        "readOnly": True,
        "subPath": "llama-3.1-8b-instruct",
    }
    assert engine["args"][engine["args"].index("--model") + 1] == mount["mountPath"]
    [check] = pod["initContainers"]
    assert check["name"] == "weights-check"
    assert check["volumeMounts"] == [mount, {"name": "tmp", "mountPath": "/tmp"}]
    assert check["command"][-1] == mount["mountPath"]


def test_the_scheduling_fields_are_the_pools_over_the_charts_defaults(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = rendered_pod(helm, monkeypatch)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    # The chart's default: a class of the user's (examples/priorityclass.yaml), never system-*.
    assert pod["priorityClassName"] == "kvbank-inference"
    priority_class = load_example("priorityclass.yaml")
    assert priority_class["metadata"]["name"] == "kvbank-inference"
    assert 0 < priority_class["value"] < 1_000_000_000  # user classes stay below a billion
    [spread] = pod["topologySpreadConstraints"]
    assert spread["labelSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kvbank", "kvbank.dev/pool": "llama-8b"}
    }
    engine = pod["containers"][0]
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},  # the pool's, over the chart's 4 / 32Gi
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},  # memory: a limit too
    }
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


def test_a_bad_chart_default_stops_the_operator_naming_the_value(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(helm, "pools.template.shmSize=lots")
    with pytest.raises(
        SystemExit, match=r"pools\.template\.shmSize: must be a Kubernetes quantity"
    ):
        parsed_operator_config(env_of(one(docs, "Deployment")), monkeypatch)


def test_the_pod_monitor_scrapes_the_engine_and_the_sidecar(helm: Tools) -> None:
    monitor = one(with_example(helm), "PodMonitor")
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"metrics", "http"}
    assert endpoints["http"]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "rank"


def exported_metrics() -> set[str]:
    names = set()
    for path in METRIC_SOURCES:
        names |= set(re.findall(r'"(kvbank_[a-z_]+)"', path.read_text()))
    names |= {
        f"kvbank_pages_{f}" for f in ("total", "free", "evictable", "reserved", "outstanding")
    }
    return names


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metric names the panels query, as exposed (a counter's _total, a histogram's _bucket)."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\b((?:kvbank_|vllm:)[a-z_:]+)\{", target["expr"]))
    return names


def unexported(names: set[str], known: set[str]) -> set[str]:
    """Names that are no known metric, as is or as one of its exposition series."""
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    return {
        n
        for n in names
        if not any(n.endswith(s) and n[: len(n) - len(s)] in known for s in suffixes)
    }


def test_the_dashboard_config_map_reads_metrics_the_code_exports(helm: Tools) -> None:
    docs = with_example(helm)
    [config_map] = [c for c in by_kind(docs, "ConfigMap") if "kvbank.json" in c["data"]]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["kvbank.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kvbank.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "promised",
        "held",
        "queue",
        "first token",
        "per output token",
        "preemptions",
        "recomputed",
        "host tier",
    ):
        assert topic in titles, topic
    read = dashboard_metrics(dashboard)
    assert {"kvbank_pages_reserved", "kvbank_pages_outstanding", "kvbank_pool_held_pages"} <= read
    unknown = unexported(read, exported_metrics() | PENDING_METRICS)
    assert unknown == set(), f"the dashboard reads metrics nothing exports: {sorted(unknown)}"
    assert not by_kind(render(helm, "metrics.dashboard.enabled=false"), "ConfigMap")


def test_the_metric_check_notices_a_misspelt_name() -> None:
    bad = {"panels": [{"targets": [{"expr": 'sum(kvbank_pages_reservd{pool="x"})'}]}]}
    assert unexported(dashboard_metrics(bad), exported_metrics()) == {"kvbank_pages_reservd"}
    good = {"panels": [{"targets": [{"expr": 'rate(kvbank_admissions_total{pool="x"}[5m])'}]}]}
    assert unexported(dashboard_metrics(good), exported_metrics()) == set()


def test_the_keda_example_scales_a_modelpool_on_a_metric_the_monitor_labels(helm: Tools) -> None:
    from kvbank.operator.crd.modelpool_crd import modelpool_crd

    [(_, scaled)] = load_documents(str(ROOT / "examples" / "keda-scaledobject.yaml"))
    target = scaled["spec"]["scaleTargetRef"]
    crd = modelpool_crd()
    assert (target["apiVersion"], target["kind"]) == (
        f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}",
        crd["spec"]["names"]["kind"],
    )
    assert "scale" in crd["spec"]["versions"][0]["subresources"]
    [trigger] = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    names = set(re.findall(r"\b(kvbank_[a-z_]+)\{", query))
    assert names and unexported(names, exported_metrics()) == set()
    # The pool label the query filters on is the one the PodMonitor writes.
    monitor = one(with_example(helm), "PodMonitor")
    labels = {
        r["targetLabel"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]
    }
    assert 'pool="llama-8b"' in query and "pool" in labels


def test_image_volumes_reach_the_operator_only_when_asked(
    helm: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value, expected in (("false", False), ("true", True)):
        docs = render(helm, f"pools.imageVolumes={value}")
        config = parsed_operator_config(env_of(one(docs, "Deployment")), monkeypatch)
        assert config.render.image_volumes is expected
