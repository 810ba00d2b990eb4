"""An in-memory stand-in for `kvbank.operator.cluster.Cluster`, with the same failure policy,
so reconcile, admission, TLS and handler tests run without an apiserver."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

from kvbank.operator.cluster import (
    KubeConflict,
    KubeError,
    KubeUnavailable,
    identity,
    resource_path,
)

Key = tuple[str, str, str | None, str]  # apiVersion, kind, namespace, name


def _merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386)."""
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _selects(selector: str | None, labels: Mapping[str, str]) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeCluster:
    def __init__(self, *, apis: tuple[str, ...] = ()) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.apis = set(apis)
        self.calls: list[tuple[str, str]] = []  # (verb, "Kind/name")
        self.fail_after: int | None = None  # raise KubeUnavailable on the call after N more
        self._versions = itertools.count(1)
        self._uids = itertools.count(1)

    # ---- test helpers ------------------------------------------------------------------------

    def put(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(manifest))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._uids)}")
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[identity(obj)] = obj
        return copy.deepcopy(obj)

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [o for (_, k, _, _), o in sorted(self.objects.items()) if k == kind]

    def one(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            o
            for (_, k, ns, n), o in self.objects.items()
            if k == kind and n == name and (namespace is None or ns == namespace)
        ]
        assert len(found) == 1, (kind, name, found)
        return found[0]

    @staticmethod
    def _mapped(api_version: str, kind: str, namespace: str | None) -> None:
        """As the real client does: a kind with no REST mapping fails here too."""
        resource_path(api_version, kind, namespace=namespace or "ns")

    def _tick(self, verb: str, what: str) -> None:
        if self.fail_after is not None:
            if self.fail_after == 0:
                raise KubeUnavailable(503, f"{verb} {what}: the apiserver went away")
            self.fail_after -= 1
        self.calls.append((verb, what))

    # ---- the Cluster protocol ------------------------------------------------------------------

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        self._mapped(api_version, kind, namespace)
        self._tick("get", f"{kind}/{name}")
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found else None

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        self._mapped(api_version, kind, namespace)
        self._tick("list", kind)
        return [
            copy.deepcopy(o)
            for (v, k, ns, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
            if v == api_version
            and k == kind
            and (namespace is None or ns == namespace)
            and _selects(label_selector, (o.get("metadata") or {}).get("labels") or {})
        ]

    async def apply(self, manifest: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        key = identity(manifest)
        self._mapped(key[0], key[1], key[2])
        self._tick("apply" + ("/dry-run" if dry_run else ""), f"{key[1]}/{key[3]}")
        current = self.objects.get(key)
        if current is None:
            return copy.deepcopy(dict(manifest)) if dry_run else self.put(manifest)
        merged = copy.deepcopy(dict(manifest))
        merged["metadata"] = {**current["metadata"], **merged["metadata"]}
        if "status" in current:
            merged["status"] = current["status"]
        if dry_run:
            return merged
        if merged != current:
            merged["metadata"]["resourceVersion"] = str(next(self._versions))
            self.objects[key] = merged
        return copy.deepcopy(merged)

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        key = identity(manifest)
        self._mapped(key[0], key[1], key[2])
        self._tick("create", f"{key[1]}/{key[3]}")
        if key in self.objects:
            return None
        return self.put(manifest)

    async def replace(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        key = identity(manifest)
        self._tick("replace", f"{key[1]}/{key[3]}")
        current = self.objects.get(key)
        version = (manifest.get("metadata") or {}).get("resourceVersion")
        if current is None:
            raise KubeError(404, f"{key[1]}/{key[3]} not found")
        # No resourceVersion: an unconditional update, as the apiserver takes for a Secret.
        if version is not None and version != current["metadata"]["resourceVersion"]:
            raise KubeConflict(409, f"{key[1]}/{key[3]} changed")
        return self.put(manifest)

    async def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        self._tick("patch" + (f"/{subresource}" if subresource else ""), f"{kind}/{name}")
        key = (api_version, kind, namespace, name)
        current = self.objects.get(key)
        if current is None:
            return None
        if subresource == "status":
            patch = {"status": patch.get("status")}
        self.objects[key] = _merge(current, patch)
        return copy.deepcopy(self.objects[key])

    async def delete(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> bool:
        self._tick("delete", f"{kind}/{name}")
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    async def api_available(self, group_version: str) -> bool:
        self._tick("discover", group_version)
        return group_version in self.apis
