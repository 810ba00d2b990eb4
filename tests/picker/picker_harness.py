"""Real sidecars on loopback, each with an engine session (the pod serves), a `kvbank picker`
over them in a thread, and an ext_proc client that drives a stream exactly as Envoy does:
the request headers (with Envoy's protocol_config and, when given, the subset hint), then the
body in chunks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
from sidecar_harness import ThreadSidecar, make_config

from kvbank.picker import server
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.client import SidecarClient

POOL = """apiVersion: kvbank.dev/v1alpha1
kind: ModelPool
metadata: {name: tiny, namespace: default}
spec:
  model:
    name: tiny
    architecture: {layers: 2, attentionHeads: 4, kvHeads: 2, headDim: 16, parameters: 1.0e6,
                   dtype: float32}
  replicas: 2
  tensorParallel: 1
  gpu: {memoryGiB: 1, memoryUtilization: 0.9, reservedGiB: 0}
  kv: {pageSize: 16, pages: 101}
  kvSlots: {main: {prompt: 1, output: 1}}
  limits: {maxSeqLen: 1024, maxTokens: 512}
"""
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED


PACE = pb.LedgerPace(page_size=16, speculative_tokens=0, backfill_depth=8, max_advance=1)


class Pod:
    """A sidecar whose engine session is open, with 100 free pages; its ledger the banker's,
    or `policy`'s (a peak-fit one reads requests' shapes)."""

    def __init__(self, index: int, policy: str = "") -> None:
        config = make_config(pool_pages=101, **({"policy": policy} if policy else {}))
        self.sidecar = ThreadSidecar(config).start_and_wait()
        self.endpoint = f"10.0.0.{index + 1}:8000"
        self.client = SidecarClient(self.sidecar.address)
        opened = self.client.open_session(
            pb.OpenSessionRequest(
                engine_id=f"engine-{index}",
                total_pages=101,
                lease_ms=600_000,
                supply=pb.Supply(free=100, evictable=0),
                policy=policy,
                pace=PACE if policy else None,
            )
        )
        self.session, self.reports = opened.session, 0

    def admit(self, rid: str, pages: int, shape: pb.PeakShape) -> None:
        """The engine submits a request with its shape and starts it (its ledger admits it)."""
        self.reports += 1
        event = pb.Event(submit=pb.Submit(rid=rid, pages=pages, shape=shape))
        reply = self.client.report(
            pb.ReportRequest(session=self.session, report_seq=self.reports, applied_seq=-1,
                             events=[event], admit=True, in_step=True, tries=[pb.Try(rid=rid)])
        )  # fmt: skip
        assert [d.rid for d in reply.decisions] == [rid]

    def submit(self, rid: str, pages: int, hold: str = "") -> None:
        self.reports += 1
        event = pb.Event(submit=pb.Submit(rid=rid, pages=pages, hold=hold))
        self.client.report(pb.ReportRequest(session=self.session, report_seq=self.reports,
                                            applied_seq=-1, events=[event]))  # fmt: skip

    def cancel(self, rid: str) -> None:
        """The engine drops a waiting request (its client went away): its pages free."""
        self.reports += 1
        event = pb.Event(cancel=pb.Cancel(rid=rid))
        self.client.report(pb.ReportRequest(session=self.session, report_seq=self.reports,
                                            applied_seq=-1, events=[event]))  # fmt: skip

    def figures(self) -> pb.RoutingFigures:
        with grpc.insecure_channel(self.sidecar.address) as channel:
            stream = pb_grpc.RoutingStub(channel).Watch(pb.WatchRequest())
            figures = next(stream)
            stream.cancel()
            return figures

    def stop(self) -> None:
        self.client.close()
        self.sidecar.shutdown()


class ThreadPicker(threading.Thread):
    def __init__(self, pods: list[Pod], pool_file: Path, *extra: str) -> None:
        super().__init__(daemon=True)
        parser = argparse.ArgumentParser()
        server.add_arguments(parser)
        argv = ["--listen", "127.0.0.1:0", "--metrics-port", "-1", "--pool", str(pool_file),
                "--builtin-model", "--loss-after-s", "2", *extra]  # fmt: skip
        for pod in pods:
            argv += ["--pod", f"{pod.endpoint}={pod.sidecar.address}"]
        self.config = server.config_from_args(parser.parse_args(argv))
        self.ready = threading.Event()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self.pod_api: Any = None  # a Kubernetes client for discovery (`--selector`)

    def run(self) -> None:
        async def main() -> None:
            self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
            api = self.pod_api
            await server.serve(self.config, self._stop_event, self._on_ready,
                               (lambda: api) if api is not None else None)  # fmt: skip

        asyncio.run(main())

    def _on_ready(self, port: int) -> None:
        self.port = port
        self.ready.set()

    def start_and_wait(self) -> ThreadPicker:
        self.start()
        assert self.ready.wait(20), "the picker did not start within 20 s"
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            ask = health_pb2.HealthCheckRequest(service="readiness")
            deadline = time.monotonic() + 20
            while health.Check(ask).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the picker was not ready within 20 s"
                time.sleep(0.02)
        return self

    def shutdown(self) -> None:
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self.join(10)


def envoy_stream(body: bytes | dict[str, Any], path: str = "/v1/completions",
                 chunk: int = 7, subset: list[str] | None = None, mode: int = FULL_DUPLEX,
                 content_length: int | None = None) -> Iterator[ep.ProcessingRequest]:  # fmt: skip
    """One request as Envoy streams it to the picker."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    length = len(raw) if content_length is None else content_length
    headers = [(":method", "POST"), (":path", path), ("content-type", "application/json"),
               ("content-length", str(length))]  # fmt: skip
    first = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),  # type: ignore[arg-type]
    )  # fmt: skip
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    yield first
    pieces = [raw[i : i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    for i, piece in enumerate(pieces):
        yield ep.ProcessingRequest(
            request_body=ep.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)
        )
