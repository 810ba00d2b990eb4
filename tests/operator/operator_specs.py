"""Small builders of ModelPool and CapacityPolicy documents for the operator's tests."""

from __future__ import annotations

import copy
from typing import Any


def pool_doc(name: str = "llama", namespace: str = "team-a", **spec: Any) -> dict[str, Any]:
    """A holdable single-label pool (Llama 3.1 8B shape on an 80 GiB GPU); keyword arguments
    replace whole spec sections."""
    base: dict[str, Any] = {
        "model": {"name": "llama-3.1-8b-instruct", "architecture": {"preset": "llama-3.1-8b"}},
        "replicas": 2,
        "tensorParallel": 1,
        "gpu": {"memoryGiB": 80, "memoryUtilization": 0.9, "reservedGiB": 2},
        "kv": {"pageSize": 16, "pages": 20000, "speculativeTokens": 1},
        "kvSlots": {"main": {"prompt": 1, "output": 1}},
        "limits": {"maxSeqLen": 8192, "maxTokens": 2048},
    }
    base.update(copy.deepcopy(spec))
    return {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": base,
    }


def stored(doc: dict[str, Any], uid: str = "uid-1", created: str = "2026-01-01T00:00:00Z"):
    """The document as the apiserver would hand it to a handler."""
    out = copy.deepcopy(doc)
    out["metadata"].update(uid=uid, generation=1, creationTimestamp=created)
    return out


def policy_doc(name: str, limits: dict[str, Any], selector: Any = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"limits": limits}
    if selector is not None:
        spec["namespaceSelector"] = selector
    return {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "CapacityPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def namespace_doc(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }
