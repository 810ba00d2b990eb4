"""The picker finds its pods in Kubernetes (`--selector`): Ready pods join the candidates, pods
that turn unready or go away leave them, each change logged. Unit tests of the discovery over
the fake client, and a real picker with a real sidecar whose pod comes and goes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from fake_pods import FakePodApi, pod
from picker_harness import Pod, ThreadPicker
from test_picker_protocol import PROMPT, answers, destination, status_of

from kvbank.picker import server
from kvbank.picker.discovery import Discovery, Target, ready_pod
from kvbank.picker.metrics import PickerMetrics
from kvbank.picker.sidecars import Link, Sidecars

TARGET = Target("default", "kvbank.dev/pool=tiny,kvbank.dev/rank=0", 8000, 50051)


def test_a_candidate_is_a_ready_pod_with_an_ip_not_being_deleted() -> None:
    made = ready_pod(pod("a", "10.1.0.7", hostname="tiny-0", subdomain="tiny-ranks"), TARGET)
    assert made is not None
    assert (made.endpoint, made.sidecar) == ("10.1.0.7:8000", "10.1.0.7:50051")
    assert made.tls_name == "tiny-0.tiny-ranks.default.svc"  # a name the pool's cert covers
    assert ready_pod(pod("a", "10.1.0.7"), TARGET).tls_name is None  # type: ignore[union-attr]
    assert ready_pod(pod("a", "fd00::5"), TARGET).endpoint == "[fd00::5]:8000"  # type: ignore[union-attr]
    assert ready_pod(pod("a", None), TARGET) is None
    assert ready_pod(pod("a", "10.1.0.7", ready=False), TARGET) is None
    deleting = pod("a", "10.1.0.7")
    deleting["metadata"]["deletionTimestamp"] = "2026-12-02T07:00:00Z"
    assert ready_pod(deleting, TARGET) is None
    assert ready_pod({"metadata": {"name": "a"}}, TARGET) is None


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_pods_join_and_leave_as_they_turn_ready_unready_and_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvbank.picker")
    api = FakePodApi(pod("a", "10.1.0.1"), pod("b", "10.1.0.2", ready=False))

    async def main() -> None:
        sidecars = Sidecars([], Link(), PickerMetrics())  # not started: no watches dialled
        discovery = Discovery(api, TARGET, sidecars)
        discovery.start()
        assert not sidecars.synced  # nothing is known before the first list
        await until(lambda: sidecars.listed, "the first list was never applied")
        assert api.lists == [("default", TARGET.selector)]
        assert list(sidecars.watched) == ["10.1.0.1:8000"]

        api.put("MODIFIED", pod("b", "10.1.0.2"))
        await until(lambda: "10.1.0.2:8000" in sidecars.watched, "b never joined")
        api.put("MODIFIED", pod("a", "10.1.0.1", ready=False))
        await until(lambda: "10.1.0.1:8000" not in sidecars.watched, "a never left")
        api.put("DELETED", pod("b", "10.1.0.2"))
        await until(lambda: not sidecars.watched, "b never left")

        # The watch expires while a pod changes unseen: the list finds it.
        api.pods["uid-c"] = pod("c", "10.1.0.3")
        api.expire()
        await until(lambda: "10.1.0.3:8000" in sidecars.watched, "no list after a 410")
        # The API is unreachable for a while: the pods stay, the list is retried.
        api.fail_lists = 2
        del api.pods["uid-c"]
        api.expire()
        await until(lambda: not sidecars.watched, "c, gone meanwhile, never left")
        assert len(api.lists) == 5
        await discovery.stop()

    asyncio.run(main())
    text = caplog.text
    assert "pod 10.1.0.1:8000 joins (sidecar 10.1.0.1:50051)" in text
    assert "pod 10.1.0.1:8000 leaves the candidates (not Ready)" in text
    assert "pod 10.1.0.2:8000 leaves the candidates (deleted)" in text
    assert "pod 10.1.0.3:8000 leaves the candidates (gone when the pods were listed again)" in text
    assert "cannot list or watch pods in default" in text


def test_a_picker_with_a_selector_routes_to_the_ready_pods_it_found(pool_file: Path) -> None:
    """A real sidecar on 127.0.0.1 behind a fake pod whose IP is 127.0.0.1: picked while Ready,
    503 once it is not, picked again when it is back."""
    live = Pod(0)
    port = int(live.sidecar.address.rsplit(":", 1)[1])
    api = FakePodApi(pod("tiny-0", "127.0.0.1"))
    picker = ThreadPicker([], pool_file, "--selector", TARGET.selector, "--namespace", "default",
                          "--sidecar-port", str(port))  # fmt: skip
    picker.pod_api = api
    picker.start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            extproc = ep_grpc.ExternalProcessorStub(channel)
            assert destination(answers(extproc, PROMPT))[0] == "127.0.0.1:8000"
            api.put("MODIFIED", pod("tiny-0", "127.0.0.1", ready=False))
            deadline = time.monotonic() + 5
            while (replies := answers(extproc, PROMPT))[-1].HasField("request_headers"):
                assert time.monotonic() < deadline, "an unready pod was still picked"
            assert status_of(replies)[0] == 503
            api.put("MODIFIED", pod("tiny-0", "127.0.0.1"))
            deadline = time.monotonic() + 5
            while not any(r.HasField("request_headers") for r in answers(extproc, PROMPT)):
                assert time.monotonic() < deadline, "the pod never came back"
                time.sleep(0.02)
    finally:
        picker.shutdown()
        live.stop()


def test_selector_and_pods_are_one_or_the_other_and_the_namespace_is_needed(
    pool_file: Path,
) -> None:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    base = ["--pool", str(pool_file), "--builtin-model"]
    for extra, message in [
        (["--pod", "10.0.0.1:8000=10.0.0.1:50051", "--selector", "a=b"], "not both"),
        (["--selector", "a=b", "--namespace", "x", "--target-port", "0"], "must be ports"),
        ([], "--selector LABELS"),
    ]:
        with pytest.raises(server.ConfigError, match=message):
            server.config_from_args(parser.parse_args(base + extra))
    if not server.SA_NAMESPACE.exists():  # outside a pod: no namespace of its own to default to
        with pytest.raises(server.ConfigError, match="needs --namespace outside a pod"):
            server.config_from_args(parser.parse_args([*base, "--selector", "a=b"]))
