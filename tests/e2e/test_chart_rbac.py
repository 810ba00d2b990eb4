"""The chart's RBAC is docs/rbac.md's table, verb for verb and name for name, in both modes: every
namespace (one ClusterRole) and a list of namespaces (Roles there). `helm template` only; no
cluster is needed."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from e2e_kube import CHART, FIRST_USE_TIMEOUT, ROOT, Tools, ensure_tools

pytestmark = pytest.mark.timeout(FIRST_USE_TIMEOUT)

DOC = ROOT / "docs" / "rbac.md"
RELEASE_NAMESPACE = "kvbank-system"
WATCHED = ("team-a", "team-b")
# (kind, namespace, API group, resource, verbs, names)
Row = tuple[str, str | None, str, str, frozenset[str], tuple[str, ...]]


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Tools:
    return Tools(ensure_tools(), tmp_path_factory.mktemp("helm") / "kubeconfig")


def render(helm: Tools, *sets: str) -> list[dict[str, Any]]:
    args = ["template", "kvbank", str(CHART), "-n", RELEASE_NAMESPACE, "--kube-version", "1.36.0"]
    for value in sets:
        args += ["--set", value]
    out = helm.helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def doc_table() -> list[dict[str, str]]:
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def _words(cell: str) -> list[str]:
    return [w for w in re.split(r"[,\s]+", cell.replace("`", "").strip()) if w]


def expected(mode: str, watched: tuple[str, ...]) -> set[Row]:
    """The table's rows for `mode`, as the objects that should hold them."""
    out: set[Row] = set()
    for row in doc_table():
        if row["mode"] not in ("both", mode):
            continue
        group = row["API group"].strip("`").replace('""', "")
        names = tuple(watched) if row["names"] == "watchNamespaces" else tuple(_words(row["names"]))
        key = (group, row["resource"].strip("`"), frozenset(_words(row["verbs"])), names)
        if row["where"] == "cluster" or (row["where"] == "pools" and mode == "cluster-wide"):
            out.add(("ClusterRole", None, *key))
        elif row["where"] == "pools":
            out.update(("Role", namespace, *key) for namespace in watched)
        else:
            out.add(("Role", RELEASE_NAMESPACE, *key))
    return out


def granted(docs: list[dict[str, Any]]) -> set[Row]:
    out: set[Row] = set()
    for kind in ("ClusterRole", "Role"):
        for role in by_kind(docs, kind):
            namespace = role["metadata"].get("namespace")
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        verbs = frozenset(rule["verbs"])
                        names = tuple(rule.get("resourceNames") or ())
                        row = (kind, namespace, group, resource, verbs, names)
                        assert row not in out, f"granted twice: {row}"
                        out.add(row)
    return out


def test_the_table_parses_into_every_scope() -> None:
    rows = doc_table()
    assert {r["where"] for r in rows} == {"cluster", "pools", "release"}
    assert {r["mode"] for r in rows} == {"both", "cluster-wide", "namespaced"}


def test_cluster_wide_rules_are_the_table(helm: Tools) -> None:
    docs = render(helm)
    assert granted(docs) == expected("cluster-wide", ())


def test_namespaced_rules_are_the_table(helm: Tools) -> None:
    docs = render(helm, "operator.watchNamespaces={" + ",".join(WATCHED) + "}")
    assert granted(docs) == expected("namespaced", WATCHED)
    # Nothing of a pool's is granted cluster-wide in this mode.
    cluster = {row[3] for row in granted(docs) if row[0] == "ClusterRole"}
    assert cluster == {"capacitypolicies", "namespaces", "validatingwebhookconfigurations"}
    bindings = {
        (b["metadata"].get("namespace"), b["roleRef"]["name"]) for b in by_kind(docs, "RoleBinding")
    }
    assert bindings == {
        *((ns, "kvbank-operator-pools") for ns in WATCHED),
        (RELEASE_NAMESPACE, "kvbank-operator-webhook-tls"),
    }


def test_no_pod_is_ever_written(helm: Tools) -> None:
    for docs in (render(helm), render(helm, "operator.watchNamespaces={team-a}")):
        pods = [row for row in granted(docs) if row[3] == "pods"]
        assert pods
        # Read only: get and watch too, only so that a pool's picker Role may grant them.
        assert [row[4] for row in pods] == [frozenset({"get", "list", "watch"})] * len(pods)


def test_namespaced_mode_judges_watches_and_peers_only_those_namespaces(helm: Tools) -> None:
    docs = render(helm, "operator.watchNamespaces={" + ",".join(WATCHED) + "}")
    hooks = {h["name"]: h for h in by_kind(docs, "ValidatingWebhookConfiguration")[0]["webhooks"]}
    selector = {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(WATCHED)}
        ]
    }
    assert hooks["modelpools.kvbank.dev"]["namespaceSelector"] == selector
    assert hooks["scale.modelpools.kvbank.dev"]["namespaceSelector"] == selector
    assert "namespaceSelector" not in hooks["capacitypolicies.kvbank.dev"]  # cluster-scoped
    assert by_kind(docs, "ClusterKopfPeering") == []
    peerings = by_kind(docs, "KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        (ns, "kvbank-operator") for ns in WATCHED
    }
    [deployment] = by_kind(docs, "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["KVBANK_WATCH_NAMESPACES"] == ",".join(WATCHED)  # kopf's --namespace, each
    assert env["KVBANK_PEERING"] == "kvbank-operator"
