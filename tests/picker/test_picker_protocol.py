"""The Endpoint Picker protocol as GAIE documents it, driven by an ext_proc client that streams
as Envoy does, against real sidecars on loopback."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from picker_harness import BUFFERED, STREAMED, Pod, ThreadPicker, envoy_stream

from kvbank.picker import server, sidecars

PROMPT = {"model": "tiny", "prompt": "the page cache holds the prompt", "max_tokens": 100}


def answers(
    extproc: ep_grpc.ExternalProcessorStub, *args: object, **kw: object
) -> list[ep.ProcessingResponse]:
    return list(extproc.Process(envoy_stream(*args, **kw), timeout=10))  # type: ignore[arg-type]


def destination(replies: list[ep.ProcessingResponse]) -> tuple[str, str, str]:
    """(the header's endpoint, the envoy.lb metadata's, the hold header)."""
    headers_reply = next(r for r in replies if r.WhichOneof("response") == "request_headers")
    set_headers = {
        h.header.key: h.header.raw_value.decode()
        for h in headers_reply.request_headers.response.header_mutation.set_headers
    }
    lb = headers_reply.dynamic_metadata.fields["envoy.lb"].struct_value
    return (set_headers["x-gateway-destination-endpoint"],
            lb.fields["x-gateway-destination-endpoint"].string_value,
            set_headers["x-kvbank-hold"])  # fmt: skip


def status_of(replies: list[ep.ProcessingResponse]) -> tuple[int, dict[str, object]]:
    last = replies[-1]
    assert last.WhichOneof("response") == "immediate_response", last
    return last.immediate_response.status.code, json.loads(last.immediate_response.body)


def test_a_pick_sets_the_header_and_the_metadata_and_returns_the_body(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    replies = answers(extproc, PROMPT)
    header, metadata, hold = destination(replies)
    assert header == metadata and header in {pod.endpoint for pod in pods}
    body = b"".join(
        r.request_body.response.body_mutation.streamed_response.body
        for r in replies
        if r.WhichOneof("response") == "request_body"
    )
    assert json.loads(body) == PROMPT  # the body goes on upstream as it came
    chosen = next(pod for pod in pods if pod.endpoint == header)
    held = chosen.figures()
    assert held.holds == 1 and held.headroom_pages < 100
    assert hold.startswith("cmpl-")
    chosen.submit(hold, 1)  # the engine takes the hold as its request id: its submit releases it
    assert chosen.figures().holds == 0


def test_two_picker_replicas_never_take_the_same_room(pods: list[Pod], pool_file: Path) -> None:
    # Two sequences of 512 output tokens each: 66 pages; a pod's 100 admit one at once. Four
    # such requests at the same instant through two replicas that see the same figures: the
    # sidecars' holds let exactly one start now on each pod, and queue the other two.
    # --max-hold-s 0: the two that cannot start queue at once (a lobby would hold them until
    # the first two holds expire, and then they too would start at once).
    big = {**PROMPT, "n": 2, "max_tokens": 512}
    replicas = [ThreadPicker(pods, pool_file, "--max-hold-s", "0").start_and_wait()
                for _ in range(2)]  # fmt: skip
    try:
        channels = [grpc.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
        stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]
        with ThreadPoolExecutor(4) as pool:
            chosen = list(pool.map(lambda i: destination(answers(stubs[i % 2], big))[0], range(4)))
        for channel in channels:
            channel.close()
    finally:
        for replica in replicas:
            replica.shutdown()
    assert sorted(chosen) == sorted([pods[0].endpoint, pods[1].endpoint] * 2)
    for pod in pods:
        figures = pod.figures()
        assert (figures.headroom_pages, list(figures.waiting_pages)) == (34, [66])


def test_the_subset_hint_is_honoured_and_an_empty_one_is_503(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    for _ in range(3):
        assert (
            destination(answers(extproc, PROMPT, subset=[pods[1].endpoint]))[0] == pods[1].endpoint
        )
    code, _ = status_of(answers(extproc, PROMPT, subset=["10.9.9.9:8000"]))
    assert code == 503


def test_buffered_mode_puts_the_destination_on_the_body_answer(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    replies = answers(extproc, PROMPT, mode=BUFFERED, chunk=1 << 20)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    mutation = replies[1].request_body.response.header_mutation.set_headers
    assert mutation[0].header.key == "x-gateway-destination-endpoint"
    lb = replies[1].dynamic_metadata.fields["envoy.lb"].struct_value
    assert (
        lb.fields["x-gateway-destination-endpoint"].string_value
        == mutation[0].header.raw_value.decode()
    )


def test_unholdable_is_400_with_the_capacity_message_and_best_effort_is_shed_when_full(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    code, body = status_of(answers(extproc, {**PROMPT, "n": 4, "max_tokens": 512}))
    assert code == 400
    assert "lower n to at most 3" in body["error"]["message"]  # type: ignore[index]
    fill(pods)
    code, body = status_of(answers(extproc, {**PROMPT, "service_tier": "flex"}))
    assert code == 429 and body["error"]["code"] == "shed"  # type: ignore[index]


def fill(pods: list[Pod]) -> None:
    """Both pods full: 100 pages waiting on each, as `filler-0` and `filler-1`."""
    for index, pod in enumerate(pods):
        pod.submit(f"filler-{index}", 100)
    deadline = time.monotonic() + 2
    while any(not pod_full(p) for p in pods):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def pod_full(pod: Pod) -> bool:
    return list(pod.figures().waiting_pages)[:1] == [100]


def test_a_strict_request_no_pod_admits_is_held_until_one_frees_room_and_starts_there(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    fill(pods)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(answers, extproc, PROMPT)
        time.sleep(0.5)
        assert not held.done(), "a strict request no pod admits was answered at once"
        pods[1].cancel("filler-1")  # pod 1 frees its room first
        header, _, _ = destination(held.result(timeout=5))
    assert header == pods[1].endpoint
    taken = pods[1].figures()
    # It holds room to start now there, rather than waiting in either pod's queue.
    assert taken.holds == 1 and list(taken.waiting_pages) == []
    assert list(pods[0].figures().waiting_pages) == [100]


def test_past_max_hold_a_strict_request_queues_where_it_starts_soonest(
    pods: list[Pod], pool_file: Path
) -> None:
    fill(pods)
    picker = ThreadPicker(pods, pool_file, "--max-hold-s", "0.4").start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            started = time.monotonic()
            header, _, _ = destination(answers(ep_grpc.ExternalProcessorStub(channel), PROMPT))
            waited = time.monotonic() - started
    finally:
        picker.shutdown()
    assert waited >= 0.4
    queued = next(pod for pod in pods if pod.endpoint == header).figures()
    assert len(queued.waiting_pages) == 2 and queued.holds == 1  # behind the filler


def test_holds_a_sidecar_keeps_refusing_are_retried_on_its_changes_then_answered_503(
    pods: list[Pod], pool_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Figures that show room beside holds that are always refused (another picker racing, or
    a sidecar at fault): the request is asked again as figures change, not at once, and past
    --max-hold-s it gets PICK_ATTEMPTS more tries, then 503."""
    calls: list[float] = []

    async def refused(*args: object, **kwargs: object) -> bool:
        calls.append(time.monotonic())
        return False

    monkeypatch.setattr(sidecars.Sidecars, "hold", refused)
    picker = ThreadPicker(pods, pool_file, "--max-hold-s", "1").start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            code, body = status_of(answers(ep_grpc.ExternalProcessorStub(channel), PROMPT))
    finally:
        picker.shutdown()
    assert code == 503 and "went to another request first" in body["error"]["message"]  # type: ignore[index]
    # Two pods heartbeat every 0.25 s: about 8 changes in the second held, and 4 tries after.
    assert 4 <= len(calls) <= 40, len(calls)


def test_a_bad_max_hold_is_refused_naming_the_range(pods: list[Pod], pool_file: Path) -> None:
    for value in ("-1", "nan", "7200"):
        with pytest.raises(server.ConfigError, match="--max-hold-s must be between 0"):
            ThreadPicker(pods, pool_file, "--max-hold-s", value)


def test_no_ready_endpoint_is_503(pool_file: Path) -> None:
    pods = [Pod(0)]
    pods[0].client.close()
    pods[0].sidecar.shutdown()  # the only pod's sidecar is gone
    picker = ThreadPicker(pods, pool_file).start_and_wait()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            code, _ = status_of(answers(ep_grpc.ExternalProcessorStub(channel), PROMPT))
    finally:
        picker.shutdown()
    assert code == 503


def test_health_services_follow_the_protocol(picker: ThreadPicker) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            deadline = time.monotonic() + 5
            while stub.Check(health_pb2.HealthCheckRequest(service=name)).status != 1:
                assert time.monotonic() < deadline, name
                time.sleep(0.02)


def test_hostile_bodies_get_4xx_the_stream_stays_healthy_and_no_hold_leaks(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = json.dumps(PROMPT).encode()
    cases = [
        (b"x" * (3 << 20), {}, 413),  # over --max-body-bytes
        (deep, {}, 400),
        (b"not json at all", {}, 400),
        (b'"a string"', {}, 400),
        (raw, {"content_length": len(raw) - 5}, 400),  # longer than it says
        (raw, {"content_length": len(raw) + 5}, 400),  # shorter than it says
        (raw, {"content_length": 10 << 20}, 413),
        (json.dumps({**PROMPT, "max_tokens": 513}).encode(), {}, 400),  # over limits.maxTokens
    ]
    for body, kw, expected in cases:
        code, _ = status_of(answers(extproc, body, chunk=1 << 16, **kw))
        assert code == expected, (body[:30], kw)
    assert [pod.figures().holds for pod in pods] == [0, 0]
    assert destination(answers(extproc, PROMPT))[0]  # the picker still serves


def test_a_body_mode_that_fixes_the_destination_first_is_refused_naming_the_setting(
    extproc: ep_grpc.ExternalProcessorStub,
) -> None:
    code, body = status_of(answers(extproc, PROMPT, mode=STREAMED))
    assert code == 500
    assert "request_body_mode FULL_DUPLEX_STREAMED" in body["error"]["message"]  # type: ignore[index]


def test_best_effort_queues_on_busy_pods_until_each_is_a_pool_deep_then_is_shed(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    """Pods whose room strict picks hold are busy, not full: a best-effort request queues where
    the backlog is least (its hold counts in that pod's backlog), and is shed only once every
    pod's backlog and it would pass the pod's pool."""
    for _ in range(6):  # strict picks of about 33 pages each: both pods' room is held
        code_or_pick = answers(extproc, {**PROMPT, "max_tokens": 512})
        assert destination(code_or_pick)[0]
    assert all(p.figures().headroom_pages < 10 for p in pods)
    flex = {**PROMPT, "prompt": " ".join(["shed"] * 200), "service_tier": "flex"}
    queued: list[str] = []
    while (replies := answers(extproc, flex))[-1].WhichOneof("response") != "immediate_response":
        queued.append(destination(replies)[0])
        assert len(queued) <= 40, "best-effort requests were never shed"
    code, body = status_of(replies)
    assert code == 429 and body["error"]["code"] == "shed"  # type: ignore[index]
    assert "backlog of at least" in body["error"]["message"]  # type: ignore[index]
    assert len(queued) >= 2 and set(queued) == {p.endpoint for p in pods}, queued
    for pod in pods:  # what each pod granted: its backlog, within its pool
        figures = pod.figures()
        assert 0 < figures.best_effort_backlog_pages <= figures.usable_pages
