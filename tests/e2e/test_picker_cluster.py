"""`spec.routing.picker: kvbank` against a real kube-apiserver: with the InferencePool CRD
installed (tests/data/inferencepool-crd.yaml, written from the extension's published API), every
object the operator renders for a routed pool is applied by server-side apply as the chart's
operator ServiceAccount and passes the server's validation (its RBAC lets the operator create
the picker's Role without escalate), and deleting the pool takes them all. The operator's
reconcile, as that ServiceAccount, renders them for a routed pool and deletes them when the pool
is switched back to `picker: none`, keeping the pool's own objects and one it does not own.
Then the picker's discovery, as the rendered picker ServiceAccount, lists and watches Pod
objects whose status the test patches Ready and unready (no kubelet runs: the pods never
start)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from e2e_kube import (
    CHART,
    FIRST_USE_TIMEOUT,
    ROOT,
    TOOLS,
    Tools,
    condition,
    ensure_tools,
    example,
    free_port,
    service_account_kubeconfig,
    wait_for,
)

from kvbank.capacity import holdability
from kvbank.deployment import parse_deployment
from kvbank.modelpool import parse_modelpool
from kvbank.operator.kube import KubeClient, load_api_client
from kvbank.operator.reconcile import reconcile
from kvbank.operator.render.bundle import render_pool
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.picker.discovery import Discovery, Target
from kvbank.picker.kube import KubePodApi
from kvbank.picker.metrics import PickerMetrics
from kvbank.picker.sidecars import Link, Sidecars

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(FIRST_USE_TIMEOUT)]

SYSTEM = "kvbank-system"
CRD = ROOT / "tests" / "data" / "inferencepool-crd.yaml"
START_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def admin() -> Iterator[tuple[Tools, Path]]:
    bin_dir = ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="kvbank-e2e-picker-"))
    try:
        out = subprocess.run(["bash", str(TOOLS), "start", str(work)], capture_output=True,
                             text=True, timeout=START_TIMEOUT + 60, check=False)  # fmt: skip
        assert out.returncode == 0, f"tools.sh start failed:\n{out.stderr[-4000:]}"
        tools = Tools(bin_dir, Path(out.stdout.strip().splitlines()[-1]))
        # No operator runs here: its webhook is unreachable, so it must not refuse the pool.
        install = tools.helm("install", "kvbank", str(CHART), "-n", SYSTEM, "--create-namespace",
                             "--set", f"webhook.url=https://127.0.0.1:{free_port()}",
                             "--set", "webhook.failurePolicy=Ignore")  # fmt: skip
        assert install.returncode == 0, install.stderr
        tools.ok("apply", "-f", str(CRD))
        tools.ok("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/inferencepools.inference.networking.k8s.io",
                 "crd/modelpools.kvbank.dev")  # fmt: skip
        yield tools, work
    finally:
        subprocess.run(["bash", str(TOOLS), "stop", str(work)], timeout=60, check=False)
        shutil.rmtree(work, ignore_errors=True)


def _namespace(tools: Tools) -> str:
    name = f"picker-{uuid.uuid4().hex[:6]}"
    tools.ok("create", "namespace", name)
    return name


def _routed_pool(tools: Tools) -> str:
    """A fresh namespace with the llama example applied in it, routed by kvbank's picker."""
    ns = _namespace(tools)
    doc = example("modelpool-llama-8b.yaml", ns, name="llama")
    doc["spec"]["routing"] = {"picker": "kvbank"}
    tools.ok("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    return ns


def test_the_rendered_picker_passes_validation_as_the_operator_and_goes_with_its_pool(
    admin: tuple[Tools, Path],
) -> None:
    tools, work = admin
    ns = _routed_pool(tools)
    stored = tools.get("modelpool", "llama", ns)
    assert stored is not None and stored["spec"]["routing"] == {"picker": "kvbank"}
    pool = parse_modelpool(stored)
    owner = Owner("llama", ns, stored["metadata"]["uid"])
    rendered = render_pool(pool, holdability(pool), owner, stored["spec"],
                           RenderSettings(sidecar_token="t0ken"), Workload.STATEFUL_SET,
                           parse_deployment(stored))  # fmt: skip
    operator = Tools(tools.bin, service_account_kubeconfig(
        tools, "kvbank-operator", SYSTEM, work / f"operator-{ns}.kubeconfig"))  # fmt: skip
    picker_kinds = []
    for manifest in rendered.manifests:
        out = operator.kubectl("apply", "--server-side", "--field-manager", "kvbank-operator",
                               "-f", "-", stdin=json.dumps(manifest))  # fmt: skip
        assert out.returncode == 0, f"{manifest['kind']}: {out.stderr}"
        if manifest["metadata"]["name"].startswith("llama-picker") or (
            manifest["kind"] == "InferencePool"
        ):
            picker_kinds.append((manifest["kind"].lower(), manifest["metadata"]["name"]))
    assert len(picker_kinds) == 8
    ip = tools.get("inferencepool", "llama", ns)
    assert ip is not None
    assert ip["spec"]["endpointPickerRef"]["name"] == "llama-picker"
    assert ip["spec"]["selector"]["matchLabels"]["kvbank.dev/pool"] == "llama"
    # The server's own validation refuses what the CRD forbids: the check is not vacuous.
    bad = json.loads(
        json.dumps(next(m for m in rendered.manifests if m["kind"] == "InferencePool"))
    )
    bad["metadata"]["name"] = "bad"
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    out = tools.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(bad))
    assert out.returncode != 0 and "targetPorts" in out.stderr
    # The selector docs/routing.md gives for finding them names exactly these.
    kinds = "inferencepool,deployment,service,serviceaccount,role,rolebinding,networkpolicy"
    selector = "kvbank.dev/pool=llama,app.kubernetes.io/component in (picker,inference-pool)"
    named = tools.ok("get", kinds, "-n", ns, "-l", selector, "-o", "name").split()
    assert sorted(n.split("/", 1)[1] for n in named) == sorted(k[1] for k in picker_kinds)
    assert f"-l '{selector.replace('llama', 'NAME')}'" in (ROOT / "docs" / "routing.md").read_text()
    tools.ok("delete", "modelpool", "llama", "-n", ns, "--wait=false")

    def gone() -> bool | None:
        left = [k for k in picker_kinds if tools.get(k[0], k[1], ns) is not None]
        return True if not left else None

    wait_for("the pool's picker objects to go with it", gone, 60, every=1)


def test_the_operator_removes_the_picker_when_the_pool_goes_back_to_none(
    admin: tuple[Tools, Path],
) -> None:
    tools, work = admin
    ns = _routed_pool(tools)
    kubeconfig = service_account_kubeconfig(tools, "kvbank-operator", SYSTEM,
                                            work / f"reconcile-{ns}.kubeconfig")  # fmt: skip
    cluster = KubeClient(load_api_client(str(kubeconfig)))
    settings = RenderSettings(sidecar_token="t0ken")

    def reconciled() -> None:
        stored = tools.get("modelpool", "llama", ns)
        assert stored is not None
        outcome = asyncio.run(reconcile(cluster, settings, stored))
        assert outcome.accepted, outcome.message

    kinds = "inferencepool,deployment,service,serviceaccount,role,rolebinding,networkpolicy"
    selector = "kvbank.dev/pool=llama,app.kubernetes.io/component in (picker,inference-pool)"

    def picker_objects() -> list[str]:
        return sorted(tools.ok("get", kinds, "-n", ns, "-l", selector, "-o", "name").split())

    reconciled()
    assert len(picker_objects()) == 8, picker_objects()
    # A Service with the picker's labels that the pool does not own stays.
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "theirs", "namespace": ns,
                           "labels": {"kvbank.dev/pool": "llama",
                                      "app.kubernetes.io/component": "picker"}},
              "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    tools.ok("apply", "-f", "-", stdin=json.dumps(theirs))
    tools.ok("patch", "modelpool", "llama", "-n", ns, "--type=merge",
             "-p", json.dumps({"spec": {"routing": {"picker": "none"}}}))  # fmt: skip
    reconciled()
    assert picker_objects() == ["service/theirs"]
    services = tools.items("service", ns, "kvbank.dev/pool=llama")
    assert sorted(s["metadata"]["name"] for s in services) == ["llama", "llama-ranks", "theirs"]
    assert tools.get("statefulset", "llama", ns) is not None
    assert condition(tools.get("modelpool", "llama", ns), "Routing") is None


async def _until(check: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_discovery_follows_pods_as_the_pickers_service_account(
    admin: tuple[Tools, Path],
) -> None:
    tools, work = admin
    ns = _namespace(tools)
    labels = {"app.kubernetes.io/name": "kvbank", "kvbank.dev/pool": "llama"}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "picker", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["pods"],
                       "verbs": ["get", "list", "watch"]}]}  # fmt: skip
    tools.ok("create", "serviceaccount", "picker", "-n", ns)
    tools.ok("apply", "-f", "-", stdin=json.dumps(role))
    tools.ok("create", "rolebinding", "picker", "-n", ns, "--role", "picker",
             f"--serviceaccount={ns}:picker")  # fmt: skip
    kubeconfig = service_account_kubeconfig(tools, "picker", ns, work / f"picker-{ns}.kubeconfig")

    def pod(name: str, pod_labels: dict[str, str]) -> None:
        doc = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "labels": pod_labels},
               "spec": {"containers": [{"name": "engine", "image": "kvbank"}]}}  # fmt: skip
        tools.ok("apply", "-f", "-", stdin=json.dumps(doc))

    def status(name: str, ip: str, ready: bool) -> None:
        patch = {"status": {"podIP": ip, "podIPs": [{"ip": ip}], "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}}  # fmt: skip
        tools.ok("patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge",
                 "-p", json.dumps(patch))  # fmt: skip

    pod("llama-0", labels)
    status("llama-0", "10.1.0.5", True)
    pod("other", {"app.kubernetes.io/name": "kvbank", "kvbank.dev/pool": "other"})
    status("other", "10.1.0.9", True)
    selector = "app.kubernetes.io/name=kvbank,kvbank.dev/pool=llama"

    async def main() -> None:
        sidecars = Sidecars([], Link(), PickerMetrics())  # no watches dialled: the pods are fake
        discovery = Discovery(KubePodApi(str(kubeconfig)), Target(ns, selector, 8000, 50051),
                              sidecars)  # fmt: skip
        discovery.start()
        await _until(lambda: sidecars.listed, "the first list never came")
        assert list(sidecars.watched) == ["10.1.0.5:8000"]  # not the other pool's pod
        assert sidecars.watched["10.1.0.5:8000"].pod.sidecar == "10.1.0.5:50051"
        pod("llama-1", labels)
        await asyncio.sleep(0.3)
        assert "10.1.0.6:8000" not in sidecars.watched  # no IP, not Ready yet
        await asyncio.to_thread(status, "llama-1", "10.1.0.6", True)
        await _until(lambda: "10.1.0.6:8000" in sidecars.watched, "a Ready pod never joined")
        await asyncio.to_thread(status, "llama-0", "10.1.0.5", False)
        await _until(lambda: "10.1.0.5:8000" not in sidecars.watched, "an unready pod stayed")
        await asyncio.to_thread(tools.ok, "delete", "pod", "llama-1", "-n", ns, "--wait=false")
        await _until(lambda: not sidecars.watched, "a deleted pod stayed")
        await discovery.stop()

    asyncio.run(main())
