"""The one Kubernetes client: REST paths for every kind, and the 404/409/timeout policy of
`kvbank.operator.cluster`, checked at the network boundary: urllib3's pool manager is replaced,
so requests pass through the client library's own serialisation (which once double-encoded a
merge patch that a recorder above it could not see)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import RESTClientObject

from kvbank.operator.cluster import KubeConflict, KubeError, KubeUnavailable, resource_path
from kvbank.operator.kube import KubeClient

ORIGINAL_CALL_API = k8s.ApiClient.call_api
ORIGINAL_REQUEST = RESTClientObject.request


class FakeHTTPResponse:
    """What urllib3 hands the client's REST layer."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = "fake"
        self.headers: dict[str, str] = {}
        if isinstance(body, bytes):
            self.data = body
        else:
            self.data = json.dumps(body).encode() if body is not None else b""


class Transport:
    """Stands in for urllib3's pool manager, under the client's own serialisation, so a test
    sees the bytes the apiserver would receive."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    def request(self, method, url, *, body=None, headers=None, timeout=None, **_):
        self.requests.append(
            {"method": method, "url": url, "headers": headers, "body": body, "timeout": timeout}
        )
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return FakeHTTPResponse(*answer)


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch):
    # Undo the autouse guard for the client's own layers; the network below is the fake.
    monkeypatch.setattr(k8s.ApiClient, "call_api", ORIGINAL_CALL_API)
    monkeypatch.setattr(RESTClientObject, "request", ORIGINAL_REQUEST)

    def install(*answers: Any) -> tuple[KubeClient, Transport]:
        fake = Transport(*answers)
        configuration = k8s.Configuration(host="https://kube.test")
        configuration.api_key = {"BearerToken": "secret-token"}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        api = k8s.ApiClient(configuration)
        api.rest_client.pool_manager = fake
        return KubeClient(api, timeout=3.0), fake

    return install


CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}}


class TestPaths:
    @pytest.mark.parametrize(
        ("args", "path"),
        [
            (("v1", "ConfigMap", "c", "ns"), "/api/v1/namespaces/ns/configmaps/c"),
            (("v1", "Namespace", "ns"), "/api/v1/namespaces/ns"),
            (("apps/v1", "StatefulSet", None, "ns"), "/apis/apps/v1/namespaces/ns/statefulsets"),
            (
                ("kvbank.dev/v1alpha1", "ModelPool", "p", "ns", "status"),
                "/apis/kvbank.dev/v1alpha1/namespaces/ns/modelpools/p/status",
            ),
            (
                ("kvbank.dev/v1alpha1", "CapacityPolicy"),
                "/apis/kvbank.dev/v1alpha1/capacitypolicies",
            ),
        ],
    )
    def test_rest_paths(self, args: tuple, path: str) -> None:
        assert resource_path(*args) == path

    def test_unknown_kind_and_missing_namespace_are_errors(self) -> None:
        with pytest.raises(ValueError, match="no REST mapping for v1 Widget"):
            resource_path("v1", "Widget", "w")
        with pytest.raises(ValueError, match="namespaced"):
            resource_path("v1", "ConfigMap", "c")


class TestPolicy:
    def test_apply_is_forced_server_side_apply_with_auth_and_timeout(self, transport) -> None:
        kube, fake = transport((200, CM))
        assert asyncio.run(kube.apply(CM)) == CM
        (request,) = fake.requests
        assert request["method"] == "PATCH"
        assert request["url"] == (
            "https://kube.test/api/v1/namespaces/ns/configmaps/c"
            "?fieldManager=kvbank-operator&force=true"
        )
        assert request["headers"]["Content-Type"] == "application/apply-patch+yaml"
        assert request["headers"]["authorization"] == "Bearer secret-token"
        assert json.loads(request["body"]) == CM
        assert request["timeout"].total == 3.0

    def test_a_dry_run_apply_asks_the_apiserver_to_store_nothing(self, transport) -> None:
        kube, fake = transport((200, CM))
        asyncio.run(kube.apply(CM, dry_run=True))
        (request,) = fake.requests
        assert request["url"].endswith("?fieldManager=kvbank-operator&force=true&dryRun=All")

    def test_absent_is_an_answer(self, transport) -> None:
        kube, _ = transport((404, {"message": "nope"}), (404, {}), (404, {}), (404, {}))
        assert asyncio.run(kube.get("v1", "ConfigMap", "c", "ns")) is None
        assert asyncio.run(kube.list("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ns")) == []
        assert asyncio.run(kube.delete("v1", "ConfigMap", "c", "ns")) is False
        assert asyncio.run(kube.patch("v1", "Pod", "p", "ns", {"metadata": {}})) is None

    def test_create_conflict_means_someone_else_created_it(self, transport) -> None:
        kube, _ = transport((409, {"message": "exists"}))
        assert asyncio.run(kube.create(CM)) is None

    def test_replace_conflict_is_raised_for_a_retry(self, transport) -> None:
        kube, _ = transport((409, {"message": "the object has been modified"}))
        with pytest.raises(KubeConflict, match="the object has been modified"):
            asyncio.run(kube.replace(CM))

    @pytest.mark.parametrize(
        "answer",
        [
            (503, {"message": "etcd leader changed"}),
            (429, {"message": "slow down"}),
            urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"),
            urllib3.exceptions.MaxRetryError(None, "/", "connection refused"),
            k8s.exceptions.ApiException(status=0, reason="SSLError"),
        ],
    )
    def test_timeouts_and_overload_are_retryable(self, transport, answer) -> None:
        kube, _ = transport(answer)
        with pytest.raises(KubeUnavailable):
            asyncio.run(kube.get("v1", "ConfigMap", "c", "ns"))

    def test_other_refusals_carry_the_apiservers_message(self, transport) -> None:
        kube, _ = transport((403, {"message": 'configmaps "c" is forbidden'}))
        with pytest.raises(KubeError) as caught:
            asyncio.run(kube.apply(CM))
        assert not isinstance(caught.value, KubeUnavailable)
        assert caught.value.status == 403 and "is forbidden" in str(caught.value)

    def test_merge_patch_sends_the_patch_once_encoded(self, transport) -> None:
        kube, fake = transport((200, {"status": {}}))
        patch = {"status": {"observedGeneration": 2}}
        asyncio.run(kube.patch("kvbank.dev/v1alpha1", "ModelPool", "p", "ns", patch, "status"))
        (request,) = fake.requests
        assert request["url"].endswith("/namespaces/ns/modelpools/p/status")
        assert request["headers"]["Content-Type"] == "application/merge-patch+json"
        assert json.loads(request["body"]) == patch

    def test_a_plain_text_error_keeps_its_text(self, transport) -> None:
        kube, _ = transport((500, b"etcdserver: request timed out"))
        with pytest.raises(KubeUnavailable, match="etcdserver: request timed out"):
            asyncio.run(kube.get("v1", "ConfigMap", "c", "ns"))

    def test_list_items_get_their_kind(self, transport) -> None:
        kube, fake = transport((200, {"items": [{"metadata": {"name": "p"}}]}))
        items = asyncio.run(kube.list("v1", "Pod", "ns", label_selector="kvbank.dev/pool=a"))
        assert items == [{"metadata": {"name": "p"}, "apiVersion": "v1", "kind": "Pod"}]
        assert fake.requests[0]["url"].endswith(
            "/namespaces/ns/pods?labelSelector=kvbank.dev/pool%3Da"
        )

    def test_discovery_tells_whether_an_api_is_served(self, transport) -> None:
        # the apiserver answers an unserved group with a plain-text 404
        kube, fake = transport((200, {"resources": []}), (404, b"404 page not found\n"))
        assert asyncio.run(kube.api_available("leaderworkerset.x-k8s.io/v1"))
        assert not asyncio.run(kube.api_available("leaderworkerset.x-k8s.io/v1"))
        assert fake.requests[0]["url"] == "https://kube.test/apis/leaderworkerset.x-k8s.io/v1"


def test_a_raw_call_outside_the_fake_fails_loudly() -> None:
    """The autouse guard: with no transport installed, any request raises at once."""
    configuration = k8s.Configuration(host="https://kube.test")
    kube = KubeClient(k8s.ApiClient(configuration))
    with pytest.raises(AssertionError, match="raw Kubernetes API call"):
        asyncio.run(kube.get("v1", "ConfigMap", "c", "ns"))
