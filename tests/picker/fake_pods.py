"""A fake of the picker's Kubernetes client (`kvbank.picker.kube.PodApi`): pods kept in memory;
`put` changes one and sends the event to the watch in progress, as the API server would."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from kvbank.picker.kube import Gone


def pod(name: str, ip: str | None, ready: bool = True, **spec: str) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    meta = {"name": name, "namespace": "default", "uid": f"uid-{name}"}
    return {"metadata": meta, "spec": dict(spec), "status": status}


class FakePodApi:
    def __init__(self, *pods: dict[str, Any]) -> None:
        self.pods = {p["metadata"]["uid"]: p for p in pods}
        self.version = 1
        self.lists: list[tuple[str, str]] = []
        self.fail_lists = 0  # the next N lists raise, as an unreachable API would
        self._events: queue.Queue[tuple[str, dict[str, Any]] | BaseException] = queue.Queue()
        self._lock = threading.Lock()

    def list_pods(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        with self._lock:
            self.lists.append((namespace, selector))
            if self.fail_lists:
                self.fail_lists -= 1
                raise ConnectionError("connection refused")
            return list(self.pods.values()), str(self.version)

    def watch_pods(
        self, namespace: str, selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        while True:
            try:
                event = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(event, BaseException):
                raise event
            yield event

    def put(self, kind: str, item: dict[str, Any]) -> None:
        with self._lock:
            self.version += 1
            item["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(item["metadata"]["uid"], None)
            else:
                self.pods[item["metadata"]["uid"]] = item
        self._events.put((kind, item))

    def expire(self) -> None:
        """The watch's version is too old (410): the picker must list again."""
        self._events.put(Gone("too old resource version"))
