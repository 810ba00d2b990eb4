"""Operator tests never reach a real apiserver: any raw call through the Kubernetes client
fails loudly, so a path that escapes the project's Cluster wrapper (or its fake) is a failure,
not a hang or a silent pass."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.rest import RESTClientObject


class RawApiCall(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RawApiCall(f"a raw Kubernetes API call escaped the Cluster wrapper: {args[1:3]}")


@pytest.fixture(autouse=True)
def no_raw_kubernetes_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ApiClient, "call_api", _refuse)
    monkeypatch.setattr(RESTClientObject, "request", _refuse)
