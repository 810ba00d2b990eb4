"""The gateway's side of the Endpoint Picker protocol, for the one-node tests: one request as Envoy
streams it to `kvbank picker` (the headers, then the body; tests/picker/picker_harness.py), and
what the picker answered: a pick (its endpoint, in the header and in the `envoy.lb` metadata,
and its hold) or an immediate response (its status and JSON body)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from e2e_kube import ROOT
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

sys.path.insert(0, str(ROOT / "tests" / "picker"))
from picker_harness import envoy_stream

DESTINATION = "x-gateway-destination-endpoint"
HOLD = "x-kvbank-hold"


@dataclass(frozen=True)
class Answer:
    status: int  # 200: a pick
    endpoint: str = ""  # ip:port
    hold: str = ""  # the request id the engine takes, which releases the hold
    body: dict[str, Any] | None = None  # an immediate response's body


def ask(stub: ep_grpc.ExternalProcessorStub, body: dict[str, Any]) -> Answer:
    """Stream one completion request to the picker and read its answer."""
    replies = list(stub.Process(envoy_stream(body, chunk=64), timeout=30))  # type: ignore[arg-type]
    last = replies[-1]
    if last.WhichOneof("response") == "immediate_response":
        return Answer(
            last.immediate_response.status.code, body=json.loads(last.immediate_response.body)
        )
    [headers] = [r for r in replies if r.WhichOneof("response") == "request_headers"]
    mutation = headers.request_headers.response.header_mutation.set_headers
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation}
    lb = headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
    endpoint = set_headers[DESTINATION]
    assert lb.string_value == endpoint, (lb, endpoint)  # never two different values
    return Answer(200, endpoint, set_headers.get(HOLD, ""))
