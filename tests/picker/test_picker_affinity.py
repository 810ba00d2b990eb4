"""Prefix affinity in the picker: the sidecars do not stream their prefix caches, so the picker
records where it sent each prompt's blocks, and a request whose prompt starts as an earlier
one's goes, among the pods that admit it now, to the pod that one went to."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from picker_harness import Pod
from test_picker_protocol import answers, destination

SYSTEM = list(range(1, 321))  # a 320-token shared prompt: 20 blocks of 16


def completion(tail: list[int]) -> dict[str, object]:
    return {"model": "tiny", "prompt": [*SYSTEM, *tail], "max_tokens": 8}


def test_a_shared_prefix_goes_back_to_the_pod_that_has_it(
    extproc: ep_grpc.ExternalProcessorStub, pods: list[Pod]
) -> None:
    first, _, first_hold = destination(answers(extproc, completion([400, 401])))
    # The first request's hold keeps its room off that pod: the other pod has more headroom,
    # which would decide the pick without affinity.
    chosen = next(pod for pod in pods if pod.endpoint == first)
    other = next(pod for pod in pods if pod.endpoint != first)
    assert chosen.figures().headroom_pages < other.figures().headroom_pages
    again, _, _ = destination(answers(extproc, completion([700, 701, 702])))
    assert again == first
    # An unrelated prompt has no affinity: the most headroom decides.
    unrelated = {"model": "tiny", "prompt": list(range(600, 640)), "max_tokens": 8}
    elsewhere, _, _ = destination(answers(extproc, unrelated))
    assert elsewhere == other.endpoint
    chosen.submit(first_hold, 1)
