"""What the end-to-end tests drive: the tools from tools.sh, kubectl and helm as a user runs
them, and the operator as a local process. Every wait has a deadline and every process started
here is stopped by the fixture that started it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvbank.check import load_documents

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tests" / "e2e" / "tools.sh"
CHART = ROOT / "charts" / "kvbank"
KVBANK = Path(sys.executable).parent / "kvbank"
# A cold machine builds the control plane, kubectl and helm from the Go module proxy.
ENSURE_TIMEOUT = 3600.0
# pytest-timeout counts fixture setup in the first test that uses it: room for a cold build.
FIRST_USE_TIMEOUT = int(ENSURE_TIMEOUT) + 600
COMMAND_TIMEOUT = 60.0
T = TypeVar("T")


def ensure_tools() -> Path:
    """The folder holding kube-controlplane, kubectl and helm (built once, then reused).
    KVBANK_E2E_BIN names a folder of prebuilt helm and kubectl instead, so the chart tests need
    not wait for a control-plane build; `tools.sh start` still ensures its own binary."""
    if os.environ.get("KVBANK_E2E_BIN"):
        return Path(os.environ["KVBANK_E2E_BIN"])
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(TOOLS), "ensure"],
        capture_output=True,
        text=True,
        timeout=ENSURE_TIMEOUT,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"tools.sh ensure failed ({out.returncode}):\n{out.stderr[-4000:]}")
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"tools.sh ensure printed no folder:\n{out.stderr[-4000:]}")
    print(f"tools.sh ensure: {time.monotonic() - started:.1f} s", file=sys.stderr)
    return Path(lines[-1])


def example(file: str, namespace: str | None = None, name: str | None = None) -> dict[str, Any]:
    """An examples/ manifest read as kubectl reads it (YAML 1.2 floats: `8.03e9` is a number),
    moved to `namespace` and renamed `name`."""
    [(_, doc)] = load_documents(str(ROOT / "examples" / file))
    if namespace:
        doc["metadata"]["namespace"] = namespace
    if name:
        doc["metadata"]["name"] = name
    return dict(doc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 0.2) -> T:
    """`probe()` once it returns something other than None or False; AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


@dataclass
class Tools:
    """kubectl and helm against one kubeconfig."""

    bin: Path
    kubeconfig: Path

    def _run(
        self, tool: str, args: Sequence[str], stdin: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HOME": str(self.kubeconfig.parent),
        }
        return subprocess.run(
            [str(self.bin / tool), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout: float = COMMAND_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, stdin, timeout)

    def helm(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, None, timeout)

    def ok(self, *args: str, stdin: str | None = None) -> str:
        out = self.kubectl(*args, stdin=stdin)
        assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out.stdout

    def apply(self, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        out = self.kubectl(*args)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def items(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self.ok("get", kind, "-n", namespace, "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items


@dataclass
class Operator:
    """`kvbank operator` as a local process; the apiserver reaches its webhook on loopback."""

    kubeconfig: Path
    namespace: str
    webhook_port: int
    log_dir: Path
    # What the chart's Deployment hands it from its Secret (KVBANK_SIDECAR_TOKEN).
    sidecar_token: str | None = field(default=None, repr=False)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def start(self) -> None:
        assert self.proc is None, "the operator is already running"
        self.starts += 1
        log = self.log_dir / f"operator-{self.starts}.log"
        self.logs.append(log)
        command = [
            str(KVBANK),
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            "--operator-namespace",
            self.namespace,
            "--webhook-listen",
            "127.0.0.1",
            "--webhook-port",
            str(self.webhook_port),
            "--webhook-extra-san",
            "127.0.0.1",
            "--liveness",
            "",
            "--status-interval",
            "5",
            # Drift repair within seconds, so tests that delete a child need not wait long.
            "--repair-interval",
            "3",
        ]
        env = {k: v for k, v in os.environ.items() if k != "KVBANK_SIDECAR_TOKEN"}
        if self.sidecar_token:
            env["KVBANK_SIDECAR_TOKEN"] = self.sidecar_token  # as the chart does, never a flag
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup handler runs, as when a node dies under it."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        if not self.logs or not self.logs[-1].exists():
            return "(no operator log)"
        text = self.logs[-1].read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def service_account_kubeconfig(admin: Tools, account: str, namespace: str, path: Path) -> Path:
    """A kubeconfig for the chart's ServiceAccount: the admin's cluster entry (server and CA)
    with a token from TokenRequest, so the operator has exactly the chart's RBAC."""
    token = admin.ok("create", "token", account, "-n", namespace, "--duration", "2h").strip()
    config = yaml.safe_load(admin.kubeconfig.read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [
                    {"name": account, "context": {"cluster": cluster["name"], "user": account}}
                ],
                "current-context": account,
            }
        )
    )
    path.chmod(0o600)
    return path


def condition(doc: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((doc or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None
