"""The picker's one client of the Kubernetes API: list the pool's Pods and watch them change.
Built on the official client (kubeconfig, or the pod's ServiceAccount with token refresh); it
returns the Pods as the API sends them (plain dicts), and blocks, so `kvbank.picker.discovery`
runs it in a thread of its own. Only this module imports `kubernetes`, so the tests replace it
here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

Pod = dict[str, Any]


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class PodApi(Protocol):
    def list_pods(self, namespace: str, selector: str) -> tuple[list[Pod], str]:
        """The pods matching `selector` now, and the list's resourceVersion."""
        ...

    def watch_pods(
        self, namespace: str, selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, Pod]]:
        """(ADDED | MODIFIED | DELETED, pod) after `resource_version`, until `timeout_s` or
        the server ends the watch; raises Gone when that version has expired."""
        ...


class KubePodApi:
    def __init__(self, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            try:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api = client.ApiClient(configuration)
            except config.ConfigException:
                api = config.new_client_from_config()
        self._core = client.CoreV1Api(api)

    def list_pods(self, namespace: str, selector: str) -> tuple[list[Pod], str]:
        listed = self._core.list_namespaced_pod(namespace, label_selector=selector)
        serialize = self._core.api_client.sanitize_for_serialization
        version = listed.metadata.resource_version if listed.metadata else None
        return [serialize(p) for p in listed.items], version or ""

    def watch_pods(
        self, namespace: str, selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, Pod]]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        stream = watch.Watch().stream(
            self._core.list_namespaced_pod,
            namespace,
            label_selector=selector,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            allow_watch_bookmarks=False,
        )
        try:
            for event in stream:
                kind, raw = event["type"], event["raw_object"]
                if kind == "ERROR":
                    if raw.get("code") == 410:
                        raise Gone(raw.get("message", "resourceVersion too old"))
                    raise RuntimeError(f"the pod watch failed: {raw.get('message', raw)}")
                yield kind, raw
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(str(exc.reason)) from exc
            raise
