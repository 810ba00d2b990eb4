"""The one module that talks to the Kubernetes API (see `kvbank.operator.cluster` for the
failure policy it implements). Built on the official client's ApiClient for authentication
(kubeconfig, in-cluster ServiceAccount token with refresh) and its connection pool; requests
are plain REST paths so one code path serves every kind, and run in a worker thread so the
operator's event loop never blocks on the network."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from kvbank.operator.cluster import (
    KubeConflict,
    KubeError,
    KubeUnavailable,
    identity,
    resource_path,
)

log = logging.getLogger(__name__)
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
RETRYABLE = {429, 500, 502, 503, 504}


class NoCluster(Exception):
    """No Kubernetes API to talk to: no kubeconfig and no in-cluster ServiceAccount."""


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An explicit kubeconfig wins; otherwise the in-cluster ServiceAccount, then the default
    kubeconfig (a developer's `kubectl` setup). Raises NoCluster saying which was missing."""
    try:
        if kubeconfig:
            return k8s_config.new_client_from_config(config_file=kubeconfig)
        try:
            configuration = k8s.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration)
        except k8s_config.ConfigException:
            return k8s_config.new_client_from_config()
    except (k8s_config.ConfigException, OSError) as exc:
        where = f"--kubeconfig {kubeconfig}" if kubeconfig else "no in-cluster ServiceAccount"
        raise NoCluster(
            f"cannot reach a Kubernetes API ({where}; {exc}): give --kubeconfig PATH or set "
            f"KUBECONFIG, or run the operator in a pod with a ServiceAccount"
        ) from None


class KubeClient:
    def __init__(
        self, api: k8s.ApiClient, field_manager: str = "kvbank-operator", timeout: float = 10.0
    ):
        self._api = api
        self._field_manager = field_manager
        self._timeout = timeout

    # ---- one request ------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            _, url, headers, body, _ = self._api.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(
                method, url, header_params=headers, body=body, _request_timeout=self._timeout
            )
            raw = response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(0, f"{method} {path}: {exc}") from exc
        except ApiException as exc:  # TLS failures come back as status 0
            raise KubeUnavailable(exc.status or 0, f"{method} {path}: {exc.reason}") from exc
        try:
            data = json.loads(raw) if raw else None
        except ValueError:  # some errors are plain text ("404 page not found" from discovery)
            data = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return int(response.status), data

    async def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
        absent_ok: bool = False,
        exists_ok: bool = False,
    ) -> Any:
        """The response body; None for a 404 when `absent_ok` or a 409 when `exists_ok`."""
        status, data = await asyncio.to_thread(self._call, method, path, query, body, content_type)
        if status < 300:
            return data
        message = data.get("message", "") if isinstance(data, dict) else str(data)
        if (status == 404 and absent_ok) or (status == 409 and exists_ok):
            return None
        if status == 409:
            raise KubeConflict(status, f"{method} {path}: {message}")
        if status in RETRYABLE:
            raise KubeUnavailable(status, f"{method} {path}: {message}")
        raise KubeError(status, f"{method} {path}: {message}")

    # ---- the Cluster protocol ---------------------------------------------------------------

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        path = resource_path(api_version, kind, name, namespace)
        result: dict[str, Any] | None = await self._request("GET", path, absent_ok=True)
        return result

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        path = resource_path(api_version, kind, namespace=namespace)
        data = await self._request("GET", path, query=query, absent_ok=True)
        items: list[dict[str, Any]] = (data or {}).get("items") or []
        for item in items:  # list items omit these; callers compare whole objects
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        api_version, kind, namespace, name = identity(manifest)
        path = resource_path(api_version, kind, name, namespace)
        query = [("fieldManager", self._field_manager), ("force", "true")]
        body = json.dumps(manifest)  # JSON is YAML: the apply content type takes it as is
        result: dict[str, Any] = await self._request(
            "PATCH", path, query=query, body=body, content_type=APPLY
        )
        return result

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        api_version, kind, namespace, _ = identity(manifest)
        path = resource_path(api_version, kind, namespace=namespace)
        result: dict[str, Any] | None = await self._request(
            "POST", path, body=dict(manifest), exists_ok=True
        )
        return result

    async def replace(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        api_version, kind, namespace, name = identity(manifest)
        path = resource_path(api_version, kind, name, namespace)
        result: dict[str, Any] = await self._request("PUT", path, body=dict(manifest))
        return result

    async def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        path = resource_path(api_version, kind, name, namespace, subresource)
        result: dict[str, Any] | None = await self._request(
            "PATCH", path, body=dict(patch), content_type=MERGE, absent_ok=True
        )
        return result

    async def delete(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> bool:
        path = resource_path(api_version, kind, name, namespace)
        body = {"propagationPolicy": "Background"}
        result = await self._request("DELETE", path, body=body, absent_ok=True)
        return result is not None

    async def api_available(self, group_version: str) -> bool:
        """Discovery, which every authenticated identity may read: no RBAC on CRDs needed."""
        path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return await self._request("GET", path, absent_ok=True) is not None
