"""The chart's RBAC is docs/rbac.md's table, verb for verb and name for name, in both modes: every
namespace (one ClusterRole) and a list of namespaces (Roles there), from `helm template`. Then,
on a real kube-apiserver (tools.sh: no kubelet), the chart installed in namespaced mode and the
real `kubectl auth can-i --list` asked as the operator's ServiceAccount, with its own token:
no cluster-wide write on Secrets, Pods or ConfigMaps."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_kube import (
    CHART,
    FIRST_USE_TIMEOUT,
    ROOT,
    TOOLS,
    Tools,
    ensure_tools,
    service_account_kubeconfig,
)

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


# ---- the installed chart, as kube-apiserver's authorizer answers for the ServiceAccount ------

ACCOUNT = "kvbank-operator"
UNWATCHED = "team-c"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection", "*"})
GUARDED = ("secrets", "pods", "configmaps")
# A row of `kubectl auth can-i --list`: RESOURCE [URLS] [NAMES] [VERBS]; URL rows lack RESOURCE.
CAN_I_ROW = re.compile(r"^(\S*)\s+\[([^\]]*)\]\s+\[([^\]]*)\]\s+\[([^\]]*)\]\s*$")


@pytest.fixture(scope="module")
def namespaced_operator() -> Iterator[Tools]:
    """kubectl holding the operator ServiceAccount's token, the chart installed with
    watchNamespaces team-a, team-b on a control plane of its own (stopped at the end)."""
    bin_dir = ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="kvbank-rbac-"))
    try:
        out = subprocess.run(
            ["bash", str(TOOLS), "start", str(work)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"tools.sh start failed:\n{out.stderr[-4000:]}"
        admin = Tools(bin_dir, Path(out.stdout.strip().splitlines()[-1]))
        for namespace in (*WATCHED, UNWATCHED):
            admin.ok("create", "namespace", namespace)
        install = admin.helm(
            "install", "kvbank", str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
            "--set", "operator.watchNamespaces={" + ",".join(WATCHED) + "}",
        )  # fmt: skip
        assert install.returncode == 0, install.stderr
        config = service_account_kubeconfig(
            admin, ACCOUNT, RELEASE_NAMESPACE, work / "operator.kubeconfig"
        )
        yield Tools(bin_dir, config)
    finally:
        subprocess.run(["bash", str(TOOLS), "stop", str(work)], timeout=60, check=False)
        shutil.rmtree(work, ignore_errors=True)


def can_i_list(tools: Tools, namespace: str) -> dict[str, set[str]]:
    """`kubectl auth can-i --list -n NAMESPACE`: verbs by resource (`secrets`, `statefulsets.apps`),
    for rows that name no resourceNames (a named row grants that one object only)."""
    out = tools.kubectl("auth", "can-i", "--list", "-n", namespace, "--no-headers")
    assert out.returncode == 0, out.stderr
    verbs: dict[str, set[str]] = {}
    for line in out.stdout.splitlines():
        match = CAN_I_ROW.match(line)
        assert match, f"kubectl auth can-i --list printed a row this test cannot read: {line!r}"
        resource, urls, names, row_verbs = match.groups()
        if urls.strip() or names.strip():
            continue
        verbs.setdefault(resource, set()).update(row_verbs.split())
    return verbs


def guarded_writes(verbs: dict[str, set[str]]) -> dict[str, set[str]]:
    """The write verbs held on Secrets, Pods or ConfigMaps, wildcards included."""
    out: dict[str, set[str]] = {}
    for resource, held in verbs.items():
        name, _, group = resource.partition(".")
        if group not in ("", "*") or name not in (*GUARDED, "*"):
            continue
        if held & WRITE_VERBS:
            out[resource] = held & WRITE_VERBS
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_namespaced_mode_grants_no_cluster_wide_write_on_secrets_pods_or_configmaps(
    namespaced_operator: Tools,
) -> None:
    # A namespace the operator does not watch sees only what the ClusterRole grants.
    outside = can_i_list(namespaced_operator, UNWATCHED)
    assert guarded_writes(outside) == {}, outside
    # What it does hold there is the cluster table's, read-only apart from its own webhook.
    assert "capacitypolicies.kvbank.dev" in outside, outside
    for resource in GUARDED:
        out = namespaced_operator.kubectl("auth", "can-i", "create", resource, "--all-namespaces")
        assert out.stdout.strip() == "no", f"create {resource} cluster-wide: {out.stdout}"
    # In a watched namespace the pools' Role grants exactly the writes docs/rbac.md lists, so
    # the reading above would have seen a cluster-wide one.
    inside = guarded_writes(can_i_list(namespaced_operator, WATCHED[0]))
    assert inside == {
        "secrets": {"create", "update"},
        "configmaps": {"create", "patch", "delete"},
    }, inside


@pytest.mark.e2e
@pytest.mark.slow
def test_namespaced_mode_grants_only_the_named_secret_in_the_release_namespace(
    namespaced_operator: Tools,
) -> None:
    verbs = can_i_list(namespaced_operator, RELEASE_NAMESPACE)
    assert guarded_writes(verbs) == {}, verbs
    allowed = namespaced_operator.kubectl(
        "auth", "can-i", "update", "secrets/kvbank-webhook-tls", "-n", RELEASE_NAMESPACE
    )
    assert allowed.stdout.strip() == "yes", allowed.stdout + allowed.stderr
    other = namespaced_operator.kubectl(
        "auth", "can-i", "update", "secrets/kvbank-sidecar-token", "-n", RELEASE_NAMESPACE
    )
    assert other.stdout.strip() == "no", other.stdout + other.stderr
