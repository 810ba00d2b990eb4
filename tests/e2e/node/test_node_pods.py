"""The operator's pods really running: a one-node cluster on this machine (cluster.sh: the
control plane, kube-scheduler, kube-controller-manager, containerd with runc and the CNI bridge,
the kubelet, kube-proxy and CoreDNS), driven by the real helm and kubectl as a platform team
would: install the chart (the operator runs as a pod under its ServiceAccount), put the weights
on a PersistentVolume, apply ModelPools, and talk to the engines through their Services.

The tests run in file order and share one cluster and release (module fixtures): each step
builds on what the previous ones left, and the last uninstalls the chart. The node has no GPU;
it advertises nvidia.com/gpu as an extended resource, so the pods that ask for one schedule, and
the engine runs the built-in model on CPU. The `engine: vllm` pool asks for no GPU
(gpusPerRank 0) and runs vLLM's CPU build, from the kvbank-vllm image `make images` builds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from e2e_kube import CHART, FIRST_USE_TIMEOUT, ROOT, wait_for
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from node_kube import (
    CLUSTER,
    UP_TIMEOUT,
    Node,
    cluster_down,
    cluster_up,
    container_status,
    containerd_task_pid,
    containerd_tasks,
    copy_tree_readable,
    port_forward,
    ready_pods,
    sidecar_status,
)
from picker_gateway import HOLD, ask

from kvbank.engine.model.builtin import builtin_model_dir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(int(UP_TIMEOUT) + FIRST_USE_TIMEOUT),
    pytest.mark.skipif(os.geteuid() != 0, reason="a node needs root (mounts, bridges, cgroups)"),
]

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
SYSTEM = "kvbank-system"
RELEASE = "kvbank"
NAMESPACE = "serve"
MODEL = "kvbank-builtin"  # the folder name under /models the engine's --model names
CLAIM = "kvbank-weights"
STORAGE_CLASS = "kvbank-local-weights"
POOL_SELECTOR = "kvbank.dev/pool={}"
REPAIR_TIMEOUT = 120.0
# The built-in model's figures (kvbank.engine.model.builtin.SPEC), for the webhook's judgement.
ARCHITECTURE = {
    "layers": 4,
    "attentionHeads": 8,
    "kvHeads": 2,
    "headDim": 32,
    "parameters": 2.8e6,
    "dtype": "float32",
}


@dataclass
class Session:
    node: Node
    weights: Path  # the hostPath the PersistentVolume serves

    @property
    def tools(self) -> Any:
        return self.node.tools


def chart_values(node: Node) -> list[str]:
    """The images cluster.sh imported (never pulled: pullPolicy Never), and short timers so
    that live status and drift repair show within a test's patience."""
    engine_repo, engine_tag = node.image("kvbank")
    operator_repo, operator_tag = node.image("kvbank-operator")
    vllm_repo, vllm_tag = node.image("kvbank-vllm")
    sets = {
        "operator.image.repository": operator_repo,
        "operator.image.tag": operator_tag,
        "operator.image.pullPolicy": "Never",
        "engine.image.repository": engine_repo,
        "engine.image.tag": engine_tag,
        "engine.image.pullPolicy": "Never",
        "engine.vllm.image.repository": vllm_repo,
        "engine.vllm.image.tag": vllm_tag,
        "operator.statusInterval": "5",
        "pools.repairInterval": "5",
        # Idle engines stop at once; a test machine has no requests to let finish.
        "engine.terminationGraceSeconds": "30",
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    work = Path(tempfile.mkdtemp(prefix="kvbank-node-"))
    try:
        node = cluster_up(work)
        tools = node.tools
        started = time.monotonic()
        install = tools.helm(
            "install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace",
            *chart_values(node), "--wait", "--timeout", "6m", timeout=420,
        )  # fmt: skip
        assert install.returncode == 0, f"{install.stderr}\n{node.log_tail('kubelet')}"
        print(f"chart installed, operator ready, in {time.monotonic() - started:.1f} s")
        weights = work / "weights"
        copy_tree_readable(builtin_model_dir(), weights / MODEL)
        yield Session(node, weights)
    finally:
        cluster_down(work)
        shutil.rmtree(work, ignore_errors=True)


def test_the_node_is_ready_and_advertises_gpus(session: Session) -> None:
    [node] = json.loads(session.tools.ok("get", "nodes", "-o", "json"))["items"]
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"


def test_containerd_and_the_image_layouts_share_one_copy_of_each_layer(session: Session) -> None:
    # The layers are gigabytes; a second copy in containerd's content store once filled CI's
    # disk (cluster.sh `share_blobs`).
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    content = cache / "kvbank/node-containerd/io.containerd.content.v1.content/blobs/sha256"
    layouts = [line.split()[1] for line in (session.node.work / "images").read_text().splitlines()]
    large = [
        blob
        for layout in layouts
        for blob in Path(layout, "blobs/sha256").iterdir()
        if blob.stat().st_size > 1 << 20
    ]
    assert large, layouts
    apart = [b.name for b in large if not (content / b.name).samefile(b)]
    assert not apart, f"layers containerd keeps a copy of its own: {apart}"


def test_the_cluster_prints_how_to_reach_it_and_install_the_chart_from_its_images(
    session: Session,
) -> None:
    """What `make cluster-up` prints after `cluster.sh up`: the kubeconfig, the tools, and a
    helm install that runs the images it imported, as the session's own install does."""
    out = subprocess.run(
        ["bash", str(CLUSTER), "usage", str(session.node.work)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (
        f"export KUBECONFIG={session.tools.kubeconfig} PATH={session.tools.bin}:$PATH" in out.stdout
    )
    sets = chart_values(session.node)
    for key in ("operator.image.tag", "engine.image.tag", "engine.vllm.image.tag"):
        [value] = [v for v in sets if v.startswith(f"{key}=")]
        assert f"--set {value} " in out.stdout, out.stdout
    assert f"helm install kvbank {CHART} -n kvbank-system" in out.stdout


def test_the_operator_runs_as_a_pod_under_its_service_account(session: Session) -> None:
    # Two replicas (the chart's default): both serve the webhook, kopf's peering lets one
    # reconcile, which every later test relies on.
    pods = ready_pods(session.tools, SYSTEM, "app.kubernetes.io/component=operator", 2)
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == "kvbank-operator"
        assert pod["spec"]["nodeName"] == "kvbank-node"


def weights_volume(session: Session) -> None:
    """The built-in model on a hostPath PersistentVolume, claimed in the pools' namespace."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            # Every pool runs where Pod Security "restricted" is enforced, as a platform's would.
            "metadata": {"name": NAMESPACE, "labels": RESTRICTED},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{NAMESPACE}-weights"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": STORAGE_CLASS,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(session.weights), "type": "Directory"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": NAMESPACE},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": STORAGE_CLASS,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    session.tools.ok("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def bound() -> bool:
        claim = session.tools.get("pvc", CLAIM, NAMESPACE)
        return bool(claim and claim.get("status", {}).get("phase") == "Bound")

    wait_for(f"PersistentVolumeClaim {NAMESPACE}/{CLAIM} Bound", bound, 60)


def pool(name: str, tensor_parallel: int) -> dict[str, Any]:
    """The built-in model (4 layers, 2 KV heads of 32) with its weights on the claim."""
    return {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {
                "name": MODEL,
                "source": {"pvc": {"claimName": CLAIM, "subPath": MODEL}},
                "architecture": ARCHITECTURE,
            },
            "replicas": 1,
            "tensorParallel": tensor_parallel,
            "gpu": {"memoryGiB": 1, "memoryUtilization": 0.9, "reservedGiB": 0},
            "kv": {"pageSize": 16, "pages": 256},
            "kvSlots": {"main": {"prompt": 1, "output": 1}},
            "limits": {"maxSeqLen": 512, "maxTokens": 64},
            "admission": {"minConcurrency": 4},
        },
    }


VLLM_POOL = "vllm"
# Only to start sooner on two busy cores: the model's own dtype (vLLM's CPU default would cast
# it to bfloat16), no torch.compile (a minute), the worker inside the engine-core process.
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni"]
# What Gateway API inference gateways read of a vLLM pod (the model-server protocol).
GATEWAY_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)


def vllm_pool() -> dict[str, Any]:
    """The same model under `vllm serve` with kvbank's scheduler class, on CPU (no GPU asked:
    the operator renders what vLLM's CPU build needs)."""
    doc = pool(VLLM_POOL, 1)
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens.
    doc["spec"]["kv"] = {"pageSize": 32, "pages": 256}
    doc["spec"]["engine"] = {"kind": "vllm", "args": VLLM_ARGS}
    doc["spec"]["admission"] = {"order": "prefix"}  # over the sidecar's Unix socket
    # vLLM's engine core talks to its worker through /dev/shm (160 MiB; a container's own is 64).
    doc["spec"]["template"] = {"resources": {"gpusPerRank": 0}, "shmSize": "512Mi"}
    return doc


def complete(
    port: int,
    prompt: str,
    max_tokens: int = 16,
    timeout: float = 120,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def test_a_pool_with_weights_on_a_claim_serves_a_completion_through_its_service(
    session: Session,
) -> None:
    weights_volume(session)
    out = session.tools.apply(pool("single", 1))
    assert out.returncode == 0, out.stderr
    # vLLM's pool loads (about a minute) while the tests before its own run.
    out = session.tools.apply(vllm_pool())
    assert out.returncode == 0, out.stderr
    [pod] = ready_pods(session.tools, NAMESPACE, POOL_SELECTOR.format("single"), 1)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in ("1", 1)
    with port_forward(session.tools, NAMESPACE, "service/single", 80) as port:
        result = complete(port, "the cache admits")
    assert result["choices"][0]["text"], result
    assert result["usage"]["completion_tokens"] > 0
    status = sidecar_status(session.tools, NAMESPACE, pod["metadata"]["name"])
    assert int(status["pool"]["totalPages"]) == 256
    # Idle again: every reservation the completion made is released.
    assert status["running"] == []


def test_the_pools_namespace_refuses_what_pod_security_restricted_forbids(
    session: Session,
) -> None:
    """The label is enforced here (the pools above passed it), not merely set: a pod with no
    security settings of its own (root allowed, capabilities kept) is refused."""
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "unhardened", "namespace": NAMESPACE},
        "spec": {"containers": [{"name": "c", "image": "kvbank.local/pause:any"}]},
    }
    refused = session.tools.apply(plain)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr
    assert "restricted:latest" in refused.stderr, refused.stderr
    assert session.tools.get("pod", "unhardened", NAMESPACE) is None


def test_a_tensor_parallel_pool_spans_two_pods_and_finds_rank_0_by_dns(session: Session) -> None:
    out = session.tools.apply(pool("tp2", 2))
    assert out.returncode == 0, out.stderr
    pods = ready_pods(session.tools, NAMESPACE, POOL_SELECTOR.format("tp2"), 2)
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert set(by_name) == {"tp2-0", "tp2-1"}
    # Rank 1 reaches rank 0 by the name the prelude builds, through CoreDNS.
    rank0 = "tp2-0.tp2-ranks.serve.svc.cluster.local"
    out = session.tools.kubectl(
        "exec", "-n", NAMESPACE, "tp2-1", "-c", "engine", "--",
        "python3", "-c", f"import socket; print(socket.gethostbyname({rank0!r}))",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == by_name["tp2-0"]["status"]["podIP"]
    with port_forward(session.tools, NAMESPACE, "service/tp2", 80) as port:
        result = complete(port, "two ranks decode")
    # Decoding needs both ranks (their torch.distributed group spans the two pods).
    assert result["usage"]["completion_tokens"] > 0


def test_a_vllm_pool_serves_a_completion_through_its_service_and_reports_status(
    session: Session,
) -> None:
    tools = session.tools
    started = time.monotonic()
    [pod] = ready_pods(tools, NAMESPACE, POOL_SELECTOR.format(VLLM_POOL), 1)
    print(f"vLLM pod ready {time.monotonic() - started:.1f} s after its test began")
    engine = pod["spec"]["containers"][0]
    assert engine["image"] == session.node.images["kvbank-vllm"]
    assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    assert "nvidia.com/gpu" not in engine["resources"].get("limits", {})
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    assert (env["KVBANK_ORDER"], env["KVBANK_SIDECAR"][:7]) == ("prefix", "unix://"), env
    with port_forward(tools, NAMESPACE, f"service/{VLLM_POOL}", 80) as port:
        result = complete(port, "vLLM admits through kvbank")
    assert result["choices"][0]["text"], result
    assert result["usage"]["completion_tokens"] > 0

    # The pages the webhook judged are the pages vLLM allocated and the sidecar's ledger counts.
    with (
        port_forward(tools, NAMESPACE, f"pod/{pod['metadata']['name']}", 8000) as port,
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response,
    ):
        metrics = response.read().decode()
    missing = [name for name in GATEWAY_METRICS if f"\n{name}{{" not in metrics]
    assert missing == [], f"the engine's /metrics lacks {missing}"
    [info] = [line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert 'num_gpu_blocks="256"' in info and 'block_size="32"' in info, info
    status = sidecar_status(tools, NAMESPACE, pod["metadata"]["name"])
    assert int(status["pool"]["totalPages"]) == 256
    assert status["running"] == []

    def reported() -> dict[str, Any] | None:
        doc = tools.get("modelpool", VLLM_POOL, NAMESPACE)
        conditions = {c["type"]: c for c in (doc or {}).get("status", {}).get("conditions", [])}
        ready = conditions.get("Ready", {}).get("status") == "True"
        live = (doc or {}).get("status", {}).get("live") or {}
        return doc if ready and live.get("pagesTotal") == 256 else None

    wait_for(f"ModelPool {VLLM_POOL} Ready with its live pages", reported, 60, every=1)


ROUTED_POOL = "routed"
INFERENCE_POOL_CRD = ROOT / "tests" / "data" / "inferencepool-crd.yaml"
PICKER_SELECTOR = "app.kubernetes.io/name=kvbank-picker,kvbank.dev/picker={}"
PICKER_PORT = 9002  # GAIE's endpoint picker port, as the operator renders it
HOLD_TTL_S = 5.0  # the picker's default --hold-ttl-s


def routed_pool() -> dict[str, Any]:
    """Two replicas of the built-in model behind `kvbank picker`, asking for no GPU. A request of
    2,000 output tokens takes 126 of a pod's 255 usable pages, so two picks fill a pod."""
    doc = pool(ROUTED_POOL, 1)
    doc["spec"]["replicas"] = 2
    doc["spec"]["limits"] = {"maxSeqLen": 2048, "maxTokens": 2000}
    doc["spec"]["admission"] = {"minConcurrency": 1}
    doc["spec"]["routing"] = {"picker": "kvbank"}
    # The engines run on CPU either way; asking for no GPU keeps the two replicas schedulable
    # beside the pools before this test, which hold 3 of the node's 4 advertised GPUs.
    doc["spec"]["template"] = {"resources": {"gpusPerRank": 0}}
    return doc


def test_a_pool_routed_by_kvbank_picker_places_requests_by_its_ledgers_and_drops_a_dead_sidecar(
    session: Session,
) -> None:
    """Part 5 of routing (docs/routing.md): the picker as a pod in front of two replicas, driven
    as Envoy drives it: a request that fits goes to a pod that admits it at once and is served
    there under the picker's hold; one no pod could ever hold is a 400 with the capacity
    function's message; a best-effort one queues on a busy pod and is shed (429) once every pod
    is a pool deep in backlog; and a pod whose sidecar is killed leaves the picks within a
    second."""
    tools = session.tools
    tools.ok("apply", "-f", str(INFERENCE_POOL_CRD))
    tools.ok("wait", "--for=condition=Established", "--timeout=60s",
             "crd/inferencepools.inference.networking.k8s.io")  # fmt: skip
    out = tools.apply(routed_pool())
    assert out.returncode == 0, out.stderr
    ranks = ready_pods(tools, NAMESPACE, POOL_SELECTOR.format(ROUTED_POOL), 2)
    pod_of = {p["status"]["podIP"]: p["metadata"]["name"] for p in ranks}
    pickers = ready_pods(tools, NAMESPACE, PICKER_SELECTOR.format(ROUTED_POOL), 2)
    inference_pool = tools.get("inferencepool", ROUTED_POOL, NAMESPACE)
    assert inference_pool is not None
    assert inference_pool["spec"]["endpointPickerRef"]["name"] == f"{ROUTED_POOL}-picker"
    small = {"model": MODEL, "prompt": "routed by the ledger", "max_tokens": 8}
    large = {**small, "max_tokens": 2000}
    picker = pickers[0]["metadata"]["name"]
    with (
        port_forward(tools, NAMESPACE, f"pod/{picker}", PICKER_PORT) as port,
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = ep_grpc.ExternalProcessorStub(channel)
        picked = ask(stub, small)
        assert picked.status == 200 and picked.hold.startswith("cmpl-"), picked
        ip, _, target_port = picked.endpoint.rpartition(":")
        assert ip in pod_of and target_port == "8000", (picked, pod_of)
        with port_forward(tools, NAMESPACE, f"pod/{pod_of[ip]}", 8000) as engine:
            served = complete(engine, str(small["prompt"]), 8, headers={HOLD: picked.hold})
        # The engine took the hold as its request id: its submit released the picker's hold.
        assert served["id"] == picked.hold and served["usage"]["completion_tokens"] > 0

        never = ask(stub, {**large, "n": 4})  # 4 sequences of 126 pages: no pod ever holds it
        assert never.status == 400 and never.body is not None, never
        assert "lower n to at most 2" in never.body["error"]["message"], never

        # Two strict picks of 126 pages each hold a pod's 255 usable pages (for the holds'
        # TTL): four fill both, each admitted at once. A best-effort request whose prompt needs
        # more than the 3 pages left on either still queues where the backlog is least (about
        # 94 pages to start each: two a pod); once what waits to start on every pod and it
        # would pass the pod's pool, the pods are full and it is shed.
        for _ in range(4):
            filling = ask(stub, large)
            assert filling.status == 200 and filling.endpoint, filling
        flex = {**small, "prompt": " ".join(["shed"] * 750), "service_tier": "flex"}
        queued: list[str] = []
        while (shed := ask(stub, flex)).status == 200:
            assert shed.endpoint, shed
            queued.append(shed.endpoint)
            assert len(queued) <= 6, f"best-effort requests were never shed: {queued}"
        assert shed.status == 429 and shed.body is not None, shed
        assert shed.body["error"]["code"] == "shed", shed
        assert len(set(queued)) == 2 and len(queued) >= 2, queued  # the backlog spreads them

        time.sleep(HOLD_TTL_S + 1)  # the holds expire: both pods have room again
        target = ask(stub, small).endpoint
        [victim] = [p for p in ranks if p["status"]["podIP"] == target.rpartition(":")[0]]
        sidecar = container_status(victim, "sidecar")["containerID"]
        os.kill(containerd_task_pid(sidecar.removeprefix("containerd://")), signal.SIGKILL)
        killed_at = time.monotonic()
        picks: list[tuple[float, str]] = []
        while time.monotonic() - killed_at < 1.5:
            answer = ask(stub, small)
            picks.append((round(time.monotonic() - killed_at, 3), answer.endpoint))
        after = [endpoint for at, endpoint in picks if at >= 1.0]
        assert after and target not in after, picks
    out = tools.kubectl("delete", "modelpool", ROUTED_POOL, "-n", NAMESPACE, "--wait=true",
                        "--timeout=180s", timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr


def _refusal(exc: urllib.error.HTTPError) -> str:
    """`unavailable` for the engine's 503 while its sidecar is away (code admission_unavailable,
    Retry-After given), else the error as it came."""
    body = exc.read().decode(errors="replace")
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if exc.code == 503 and code == "admission_unavailable" and exc.headers.get("Retry-After"):
        return "unavailable"
    return f"error: HTTP {exc.code} {body[:200]}"


class Load:
    """Completions sent one after another from a thread until stopped; every outcome kept."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                result = complete(self.port, f"request {n} of the load", max_tokens=32)
                self.outcomes.append("ok" if result["usage"]["completion_tokens"] > 0 else "empty")
            except urllib.error.HTTPError as exc:
                self.outcomes.append(_refusal(exc))
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self.outcomes.append(f"error: {exc}")

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


def test_a_killed_sidecar_drains_the_pod_is_restarted_and_loses_nothing(session: Session) -> None:
    tools = session.tools
    [pod] = ready_pods(tools, NAMESPACE, POOL_SELECTOR.format("single"), 1)
    name = pod["metadata"]["name"]
    before = container_status(pod, "sidecar")
    container_id = before["containerID"].removeprefix("containerd://")
    with port_forward(tools, NAMESPACE, f"pod/{name}", 8000) as port, Load(port) as load:
        wait_for("completions before the kill", lambda: len(load.outcomes) >= 3, 120)
        os.kill(containerd_task_pid(container_id), signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            current = tools.get("pod", name, NAMESPACE)
            if not current:
                return None
            status = container_status(current, "sidecar")
            restarts = status.get("restartCount", 0) > before.get("restartCount", 0)
            return current if restarts and status.get("ready") else None

        wait_for("the kubelet restarting the sidecar", restarted, 180, every=1)
        # The engine reconnects within its backoff (2 s at most) and serves again.
        wait_for("completions after the restart", lambda: load.outcomes[-3:] == ["ok"] * 3, 180)
    # While the sidecar was away new requests were refused fast and said why (503, Retry-After,
    # admission_unavailable); none failed any other way, and running ones finished.
    assert load.outcomes[:3] == ["ok"] * 3, load.outcomes
    assert set(load.outcomes) <= {"ok", "unavailable"}, load.outcomes

    # The engine re-registered what ran: once idle, no reservation is left over or doubled.
    def idle() -> dict[str, Any] | None:
        status = sidecar_status(tools, NAMESPACE, name)
        return None if status["running"] else status

    status = wait_for("an idle sidecar", idle, 60)
    assert int(status["pool"]["reserved"]) == 0


def test_a_deleted_statefulset_is_restored_by_the_operator(session: Session) -> None:
    tools = session.tools
    before = tools.get("statefulset", "single", NAMESPACE)
    assert before is not None
    tools.ok("delete", "statefulset", "single", "-n", NAMESPACE, "--wait=true")

    def restored() -> dict[str, Any] | None:
        current = tools.get("statefulset", "single", NAMESPACE)
        replaced = current and current["metadata"]["uid"] != before["metadata"]["uid"]
        return current if replaced else None

    wait_for("the operator restoring statefulset/single", restored, REPAIR_TIMEOUT, every=1)
    ready_pods(tools, NAMESPACE, POOL_SELECTOR.format("single"), 1)
    with port_forward(tools, NAMESPACE, "service/single", 80) as port:
        assert complete(port, "restored")["usage"]["completion_tokens"] > 0


def test_with_the_operator_down_a_deleted_rank_pod_comes_back_and_serves(session: Session) -> None:
    """The data plane stands alone: rank identity comes from what the workload controller
    stamps, so a replaced pod serves through its Service with no operator to label it."""
    tools = session.tools
    operator = f"deployment/{RELEASE}-operator"
    tools.ok("scale", operator, "-n", SYSTEM, "--replicas", "0")
    try:
        wait_for(
            "no operator pod",
            lambda: not tools.items("pods", SYSTEM, "app.kubernetes.io/component=operator"),
            120,
            every=1,
        )
        [pod] = ready_pods(tools, NAMESPACE, POOL_SELECTOR.format("single"), 1)
        tools.ok("delete", "pod", pod["metadata"]["name"], "-n", NAMESPACE, "--wait=true")

        def replaced() -> bool:
            pods = tools.items("pods", NAMESPACE, POOL_SELECTOR.format("single"))
            return any(p["metadata"]["uid"] != pod["metadata"]["uid"] for p in pods)

        wait_for("the StatefulSet replacing the pod", replaced, 120, every=1)
        ready_pods(tools, NAMESPACE, POOL_SELECTOR.format("single"), 1)
        with port_forward(tools, NAMESPACE, "service/single", 80) as port:
            assert complete(port, "served without an operator")["usage"]["completion_tokens"] > 0
    finally:
        tools.ok("scale", operator, "-n", SYSTEM, "--replicas", "2")
    ready_pods(tools, SYSTEM, "app.kubernetes.io/component=operator", 2)


def test_helm_upgrade_rolls_the_operator_and_the_pools_keep_serving(session: Session) -> None:
    tools = session.tools
    old = ready_pods(tools, SYSTEM, "app.kubernetes.io/component=operator", 2)
    out = tools.helm(
        "upgrade", RELEASE, str(CHART), "-n", SYSTEM, "--reuse-values",
        "--set", "operator.statusInterval=7", "--wait", "--timeout", "5m", timeout=360,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    new = ready_pods(tools, SYSTEM, "app.kubernetes.io/component=operator", 2)
    assert not {p["metadata"]["uid"] for p in new} & {p["metadata"]["uid"] for p in old}
    with port_forward(tools, NAMESPACE, "service/single", 80) as port:
        assert complete(port, "after the upgrade")["usage"]["completion_tokens"] > 0


def test_helm_uninstall_after_the_pools_leaves_nothing_behind(session: Session) -> None:
    tools = session.tools
    listed = tools.helm("get", "manifest", RELEASE, "-n", SYSTEM)
    manifest = [d for d in yaml.safe_load_all(listed.stdout) if d]
    # The pools' pods stop gracefully first (engine.terminationGraceSeconds).
    for args in (("modelpools", "--all", "-n", NAMESPACE), ("namespace", NAMESPACE)):
        out = tools.kubectl("delete", *args, "--wait=true", "--timeout=180s", timeout=240)
        assert out.returncode == 0, out.stderr
    out = tools.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout", "3m", timeout=240)
    assert out.returncode == 0, out.stderr
    out = tools.kubectl("delete", "namespace", SYSTEM, "--wait=true", "--timeout=180s", timeout=240)
    assert out.returncode == 0, out.stderr
    left = []
    for doc in manifest:
        namespace = doc["metadata"].get("namespace")
        if tools.get(doc["kind"], doc["metadata"]["name"], namespace) is not None:
            left.append(f"{doc['kind']}/{doc['metadata']['name']}")
    assert left == [], left
    # Nothing runs on the node but CoreDNS: every pool's and the operator's containers are gone.
    pods = json.loads(tools.ok("get", "pods", "-A", "-o", "json"))["items"]
    assert {p["metadata"]["namespace"] for p in pods} == {"kube-system"}

    def only_dns() -> bool:
        # CoreDNS's pod: its sandbox and its one container.
        return len(containerd_tasks()) == 2

    wait_for("the node running only CoreDNS", only_dns, 120)


NODE_COMPONENTS = (
    "containerd",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "kube-proxy",
)


def test_make_cluster_down_leaves_nothing_running(session: Session) -> None:
    """`make cluster-down` (the fixture's own teardown then finds nothing to do): every process
    the cluster started has exited, and its bridge, firewall chains, mounts and sockets are gone."""
    work = session.node.work
    pid_files = [work / f"{name}.pid" for name in (*NODE_COMPONENTS, "controlplane")]
    pids = [int(path.read_text()) for path in pid_files if path.exists()]
    assert len(pids) == len(pid_files), [str(p) for p in pid_files if not p.exists()]
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "cluster-down", f"CLUSTER_DIR={work}"],
        capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"still running after cluster-down: {alive}"
    assert [p for p in pid_files if p.exists()] == []
    link = subprocess.run(["ip", "link", "show", "kvbank0"], capture_output=True, check=False)
    assert link.returncode != 0, "the bridge kvbank0 is still there"
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout
    assert "KVBANK-NODE-GUARD" not in rules, rules
    mounts = Path("/proc/mounts").read_text()
    assert "/var/lib/kvbank-node" not in mounts and "/run/kvbank-node" not in mounts
    assert not Path("/run/kvbank-node/containerd.sock").exists()
