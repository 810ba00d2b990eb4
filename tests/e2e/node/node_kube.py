"""What the one-node tests drive: cluster.sh (a control plane, a kubelet, containerd, kube-proxy
and CoreDNS on this machine), the images it built, and the pods' own ports through
`kubectl port-forward`, as a user reaches them. Every wait has a deadline; every process
started here is stopped by whoever started it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e_kube import ENSURE_TIMEOUT, ROOT, Tools, free_port, wait_for

CLUSTER = ROOT / "tests" / "e2e" / "node" / "cluster.sh"
# A cold machine builds the node's components and the images first.
UP_TIMEOUT = ENSURE_TIMEOUT + 900
# Pulling nothing, a pod starts in seconds; the engine imports torch on a busy 2-core machine.
POD_READY_TIMEOUT = 420.0
CONTAINERD = "/run/kvbank-node/containerd.sock"


@dataclass
class Node:
    """The cluster cluster.sh brought up: admin tools, its images, and its folder."""

    tools: Tools
    images: dict[str, str]  # short name (kvbank, kvbank-operator, ...) -> image reference
    work: Path
    bring_up_s: float

    def image(self, name: str) -> tuple[str, str]:
        """(repository, tag) of one of the images the cluster imported."""
        repository, tag = self.images[name].rsplit(":", 1)
        return repository, tag

    def log_tail(self, component: str, lines: int = 40) -> str:
        path = self.work / f"{component}.log"
        if not path.exists():
            return f"(no {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def cluster_up(work: Path) -> Node:
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(CLUSTER), "up", str(work)],
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT,
        check=False,
    )
    elapsed = time.monotonic() - started
    sys.stderr.write(out.stderr[-6000:])
    if out.returncode != 0:
        raise AssertionError(f"cluster.sh up failed ({out.returncode}):\n{out.stderr[-6000:]}")
    kubeconfig = Path(out.stdout.strip().splitlines()[-1])
    bin_dir = Path(
        subprocess.run(
            ["bash", str(ROOT / "tests" / "e2e" / "tools.sh"), "ensure-node"],
            capture_output=True,
            text=True,
            timeout=ENSURE_TIMEOUT,
            check=True,
        ).stdout.splitlines()[-1]
    )
    images: dict[str, str] = {}
    for line in (work / "images").read_text().splitlines():
        reference = line.split()[0]
        images[reference.rsplit("/", 1)[1].rsplit(":", 1)[0]] = reference
    print(f"one-node cluster up in {elapsed:.1f} s", file=sys.stderr)
    return Node(Tools(bin_dir, kubeconfig), images, work, elapsed)


def cluster_down(work: Path) -> None:
    subprocess.run(["bash", str(CLUSTER), "down", str(work)], timeout=300, check=False)


def ready_pods(tools: Tools, namespace: str, selector: str, count: int) -> list[dict[str, Any]]:
    """The pods matching `selector` once exactly `count` of them run with every container
    ready."""

    def probe() -> list[dict[str, Any]] | None:
        pods = [p for p in tools.items("pods", namespace, selector) if not deleting(p)]
        ready = [p for p in pods if pod_ready(p)]
        return ready if len(pods) == count and len(ready) == count else None

    try:
        return wait_for(
            f"{count} ready pods {namespace}/{selector}", probe, POD_READY_TIMEOUT, every=2
        )
    except AssertionError as exc:
        described = tools.kubectl("describe", "pods", "-n", namespace, "-l", selector)
        raise AssertionError(f"{exc}\n{described.stdout[-5000:]}") from None


def deleting(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def pod_ready(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [status] = [s for s in pod["status"]["containerStatuses"] if s["name"] == name]
    return dict(status)


@contextmanager
def port_forward(tools: Tools, namespace: str, target: str, remote: int) -> Iterator[int]:
    """`kubectl port-forward` to `target` (service/NAME or pod/NAME) on a free loopback port;
    yields the port once it answers."""
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(tools.kubeconfig), "HOME": str(tools.kubeconfig.parent)}
    proc = subprocess.Popen(
        [str(tools.bin / "kubectl"), "port-forward", "-n", namespace, "--address", "127.0.0.1",
         target, f"{port}:{remote}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> REMOTE"
        assert "Forwarding from" in line, f"kubectl port-forward {target}: {line}"
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def copy_tree_readable(source: Path, target: Path) -> None:
    """The built-in model's files, readable by the pods' non-root user."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def containerd_task_pid(container_id: str) -> int:
    """The host pid of a running container's first process, as containerd knows it."""
    out = subprocess.run(
        ["ctr", "--address", CONTAINERD, "-n", "k8s.io", "tasks", "ls"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    for line in out.stdout.splitlines()[1:]:
        task, pid, status = line.split()[:3]
        if task == container_id and status == "RUNNING":
            return int(pid)
    raise AssertionError(f"containerd runs no task {container_id}:\n{out.stdout}")


def containerd_tasks() -> list[str]:
    out = subprocess.run(
        ["ctr", "--address", CONTAINERD, "-n", "k8s.io", "tasks", "ls", "-q"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return out.stdout.split()


def sidecar_status(tools: Tools, namespace: str, pod: str) -> dict[str, Any]:
    """`kvbank status --json` run in the pod's sidecar container against its own sidecar, with
    the pool's token (and its CA, where the operator issued the sidecar a certificate)."""
    script = (
        "ca=/etc/kvbank/sidecar-tls/ca.crt; "
        "set -- --token-file /var/run/kvbank/sidecar-token/token; "
        '[ -f "$ca" ] && set -- "$@" --ca-file "$ca"; '
        'exec kvbank status --json "$@" "127.0.0.1:${KVBANK_SIDECAR_PORT}"'
    )
    out = tools.kubectl("exec", "-n", namespace, pod, "-c", "sidecar", "--", "sh", "-c", script)
    assert out.returncode == 0, f"kvbank status in {namespace}/{pod}: {out.stderr}{out.stdout}"
    result: dict[str, Any] = json.loads(out.stdout)
    return result
