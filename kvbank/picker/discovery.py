"""The picker finds its pods in Kubernetes: the Pods in one namespace that an InferencePool's
selector matches. A Ready pod with an IP joins the candidates (its endpoint: the pod IP and the
engine's target port; its sidecar: the pod IP and the sidecar port); a pod that turns unready,
is being deleted or goes away leaves them. Each change is logged by `Sidecars.add/remove`.

The list and watch block (`kvbank.picker.kube`), so they run in a thread; every change is
handed to the event loop, which owns the sidecars' watches. A watch that ends is resumed from
its last resourceVersion; one that expired (410) or failed lists again, after a backoff capped at
5 s. Until the first list has been applied the picker is not ready (`Sidecars.listed`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvbank.picker.kube import Gone, PodApi
from kvbank.picker.sidecars import Pod, Sidecars

log = logging.getLogger("kvbank.picker")
Post = Callable[[Callable[[], Awaitable[None]]], None]
WATCH_TIMEOUT_S = 60


@dataclass(frozen=True)
class Target:
    namespace: str
    selector: str  # a label selector, as `kubectl get -l` takes it
    target_port: int  # the engine's port, the InferencePool's targetPorts
    sidecar_port: int


def selector_text(match_labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def ready_pod(pod: dict[str, Any], target: Target) -> Pod | None:
    """The candidate a Pod makes, or None when it is not one (no IP, not Ready, deleting)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp"):
        return None
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    tls_name = f"{hostname}.{subdomain}.{target.namespace}.svc" if hostname and subdomain else None
    return Pod(f"{host}:{target.target_port}", f"{host}:{target.sidecar_port}", tls_name)


class Discovery:
    def __init__(self, api: PodApi, target: Target, sidecars: Sidecars) -> None:
        self.api = api
        self.target = target
        self.sidecars = sidecars
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changes: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self._applier: asyncio.Task[None] | None = None
        self._pods: dict[str, Pod] = {}  # pod uid -> its candidate, as the thread last saw it

    def start(self) -> None:
        self.sidecars.listed = False
        loop = asyncio.get_running_loop()
        self._applier = asyncio.create_task(self._apply())

        def post(change: Callable[[], Awaitable[None]]) -> None:
            if not self._stop.is_set():  # after stop the loop may be gone
                loop.call_soon_threadsafe(self._changes.put_nowait, change)

        self._thread = threading.Thread(
            target=self._run, args=(post,), name="kvbank-picker-discovery", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()  # the thread ends at its watch's next event or timeout (a daemon)
        if self._applier is not None:
            self._applier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._applier

    async def _apply(self) -> None:
        """The changes, one at a time and in the order the thread saw them."""
        while True:
            change = await self._changes.get()
            await change()

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self, post: Post) -> None:
        backoff = 0.1
        t = self.target
        while not self._stop.is_set():
            try:
                items, version = self.api.list_pods(t.namespace, t.selector)
                seen = {
                    uid: p for item in items if (uid := _uid(item)) and (p := ready_pod(item, t))
                }
                self._sync(seen, post, "listed")
                post(self._listed)
                backoff = 0.1
                while not self._stop.is_set():
                    for kind, item in self.api.watch_pods(
                        t.namespace, t.selector, version, WATCH_TIMEOUT_S
                    ):
                        if self._stop.is_set():
                            return
                        version = (item.get("metadata") or {}).get("resourceVersion") or version
                        uid = _uid(item)
                        if not uid:
                            continue
                        pod = None if kind == "DELETED" else ready_pod(item, t)
                        why = "deleted" if kind == "DELETED" else "not Ready"
                        self._change(uid, pod, post, why)
            except Gone:
                log.info("kvbank picker: the pod watch expired; listing the pods again")
            except Exception as exc:  # the API is down or refuses: keep the pods, retry
                log.warning(
                    "kvbank picker: cannot list or watch pods in %s (%s): %s; retrying in %.1f s",
                    t.namespace,
                    t.selector,
                    exc,
                    backoff,
                )
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _sync(self, seen: dict[str, Pod], post: Post, why: str) -> None:
        for uid in list(self._pods):
            if uid not in seen:
                self._change(uid, None, post, "gone when the pods were listed again")
        for uid, pod in seen.items():
            self._change(uid, pod, post, why)

    def _change(self, uid: str, pod: Pod | None, post: Post, why: str) -> None:
        known = self._pods.get(uid)
        if pod == known:
            return
        if known is not None:
            self._pods.pop(uid)
            post(lambda: self.sidecars.remove(known.endpoint, why))
        if pod is not None:
            self._pods[uid] = pod
            post(lambda: self.sidecars.add(pod))

    async def _listed(self) -> None:
        self.sidecars.listed = True


def _uid(item: dict[str, Any]) -> str:
    meta = item.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name') or ''}")
