"""What `kvbank picker` adds to a request: decision latency on loopback with 8 pods.

    python benchmarks/picker_latency.py [--pods 8] [--rate 1000] [--seconds 5]

Starts 8 `kvbank sidecar` processes (each with an engine session open, so its pod serves) and
one `kvbank picker` process over them, then streams requests to the picker as Envoy does
(headers, then the body) at `--rate` a second, open loop. A request's decision latency is from
its last body chunk sent to the picker's header answer received: the parse, the tokenizer, the
count, the rule and the hold on the chosen sidecar, plus this client's own loop. Target (issue
23): p99 at most 1 ms.

`--peak`: the sidecars run a peak-fit ledger, each with one long request running whose
worst case leaves 200 pages of headroom, fewer than the picks' holds soon take: a request then
fits a pod only by its room curve (what it may hold at each step, kvbank/ledger/room.py), so
the picker tests each request's shape against every pod's curve, its dearest path.

Two baselines, measured in the same run: one bare `Routing.Hold` round trip (the floor of any
decision that reserves room), and a null ext_proc server (this script with `--null-server`, a
process of its own) that answers every stream with the same messages as a pick and does nothing
else, driven by the same client at the same rate: the floor of this harness, Python's gRPC on
both ends. The CPU each server process spends per request (its user and system time over the
drive, from /proc) is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.client import SidecarClient

ROOT = Path(__file__).resolve().parents[1]
PAGES = 20001
POOL = f"""apiVersion: kvbank.dev/v1alpha1
kind: ModelPool
metadata: {{name: bench, namespace: default}}
spec:
  model:
    name: bench
    architecture: {{layers: 2, attentionHeads: 4, kvHeads: 2, headDim: 16, parameters: 1.0e6,
                   dtype: float32}}
  replicas: 8
  tensorParallel: 1
  gpu: {{memoryGiB: 4, memoryUtilization: 0.9, reservedGiB: 0}}
  kv: {{pageSize: 16, pages: {PAGES}}}
  kvSlots: {{main: {{prompt: 1, output: 1}}}}
  limits: {{maxSeqLen: 2048, maxTokens: 256}}
"""
BODY = json.dumps(
    {
        "model": "bench",
        "prompt": "the ledger admits a request when every promise can still be kept " * 4,
        "max_tokens": 64,
    }
).encode()


PACE = pb.LedgerPace(page_size=16, speculative_tokens=0, backfill_depth=8, max_advance=1)
LONG_PAGES = PAGES - 1 - 200  # its worst case: 200 pages of headroom left beside it


def run_long(client: SidecarClient, session: int) -> None:
    """Start a request that may grow, a token a step, from 2 pages to LONG_PAGES."""
    worst = LONG_PAGES * 16
    shape = pb.PeakShape(labels=["main"], base=[32], per_output=[1], worst=[worst],
                         output_budget=worst - 32, prefill_chunks=1)  # fmt: skip
    submit = pb.Event(submit=pb.Submit(rid="long", pages=LONG_PAGES, shape=shape))
    reply = client.report(pb.ReportRequest(session=session, report_seq=1, applied_seq=-1,
                                           events=[submit], admit=True, in_step=True,
                                           tries=[pb.Try(rid="long")]))  # fmt: skip
    assert [d.rid for d in reply.decisions] == ["long"], reply


def start(cmd: list[str], ready: re.Pattern[str]) -> tuple[subprocess.Popen[str], int]:
    err = open(Path(tempfile.gettempdir()) / "kvbank-picker-bench.err", "a")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = ready.search(line)
    if not match:
        proc.kill()
        raise SystemExit(f"did not start: {' '.join(cmd[:4])}: {line!r}")
    return proc, int(match.group(1))


def stream(raw: bytes) -> list[ep.ProcessingRequest]:
    headers = [(":method", "POST"), (":path", "/v1/completions"),
               ("content-length", str(len(raw)))]  # fmt: skip
    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return [
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),
        ),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True)),
    ]  # fmt: skip


async def one(stub: ep_grpc.ExternalProcessorStub, out: list[float]) -> None:
    try:
        await _one(stub, out)
    except grpc.aio.AioRpcError as exc:
        FAILURES.append(f"{exc.code().name}: {exc.details()}")
    except asyncio.InvalidStateError:  # the stream ended before the body went
        FAILURES.append("the stream ended before its body was sent")


FAILURES: list[str] = []


async def _one(stub: ep_grpc.ExternalProcessorStub, out: list[float]) -> None:
    headers, body = stream(BODY)
    call = stub.Process()
    try:
        await call.write(headers)
        await call.write(body)
    except asyncio.InvalidStateError:
        FAILURES.append(f"the stream ended before its body was sent: {await call.code()} "
                        f"{await call.details()}")  # fmt: skip
        return
    sent = time.perf_counter()
    reply = await call.read()
    if reply.WhichOneof("response") != "request_headers":
        FAILURES.append(f"answered {reply.immediate_response.status.code}, not a pick")
        return
    out.append(time.perf_counter() - sent)
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


async def drive(port: int, rate: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for _ in range(50):  # warm the channel and the tokenizer
            await one(stub, [])
        tasks = []
        start_at = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = start_at + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(stub, latencies)))
        await asyncio.gather(*tasks)
    return latencies


async def holds(sidecar: str, count: int) -> list[float]:
    latencies = []
    async with grpc.aio.insecure_channel(sidecar) as channel:
        stub = pb_grpc.RoutingStub(channel)
        for i in range(count):
            request = pb.HoldRequest(hold_id=f"b{i}", pages=1, ttl_ms=1000)
            started = time.perf_counter()
            await stub.Hold(request)
            latencies.append(time.perf_counter() - started)
    return latencies[50:]


class NullProcessor(ep_grpc.ExternalProcessorServicer):
    """Answers a stream as a pick does (the header answer with a destination, then the body
    back), with no count, rule or hold."""

    async def Process(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for request in request_iterator:
            if request.WhichOneof("request") != "request_body":
                continue
            header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
                key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"))  # fmt: skip
            common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[header]))
            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
            streamed = ep.StreamedBodyResponse(body=request.request_body.body, end_of_stream=True)
            mutation = ep.BodyMutation(streamed_response=streamed)
            yield ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
            )


async def serve_null() -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving ext_proc on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    """A process's user and system time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(
    proc: subprocess.Popen[str], port: int, rate: float, seconds: float
) -> tuple[list[float], float]:
    """Decision latencies at `rate`, and the server's CPU milliseconds per request."""
    before = cpu_seconds(proc.pid)
    latencies = asyncio.run(drive(port, rate, seconds))
    return latencies, (cpu_seconds(proc.pid) - before) * 1e3 / max(1, len(latencies) + 50)


def quantiles(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100)
    return cuts[49] * 1e3, cuts[98] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--peak", action="store_true", help="peak-fit pods, admitting by curve")
    parser.add_argument("--null-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.null_server:
        asyncio.run(serve_null())
        return 0
    procs: list[subprocess.Popen[str]] = []
    try:
        sidecars = []
        for _ in range(args.pods):
            policy = ["--policy", "peak"] if args.peak else []
            proc, port = start(
                [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", "127.0.0.1:0",
                 "--metrics-port", "-1", *policy],
                re.compile(r"serving on [\d.]+:(\d+)"),
            )  # fmt: skip
            procs.append(proc)
            sidecars.append(f"127.0.0.1:{port}")
            with SidecarClient(sidecars[-1]) as client:
                session = client.open_session(pb.OpenSessionRequest(
                    engine_id="bench", total_pages=PAGES, lease_ms=3_600_000,
                    supply=pb.Supply(free=PAGES - 1, evictable=0),
                    policy="peak" if args.peak else "",
                    pace=PACE if args.peak else None)).session  # fmt: skip
                if args.peak:
                    run_long(client, session)
        pool = Path(tempfile.mkdtemp()) / "pool.yaml"
        pool.write_text(POOL)
        cmd = [sys.executable, "-m", "kvbank.cli", "picker", "--listen", "127.0.0.1:0",
               "--metrics-port", "-1", "--pool", str(pool), "--builtin-model",
               "--hold-ttl-s", "1"]  # fmt: skip
        for i, sidecar in enumerate(sidecars):
            cmd += ["--pod", f"10.0.0.{i + 1}:8000={sidecar}"]
        serving = re.compile(r"serving ext_proc on [\d.]+:(\d+)")
        proc, port = start(cmd, serving)
        procs.append(proc)
        null, null_port = start([sys.executable, __file__, "--null-server"], serving)
        procs.append(null)
        time.sleep(1.0)  # the watches' first figures
        baseline = asyncio.run(holds(sidecars[0], 1050))
        picks, pick_cpu = measured(proc, port, args.rate, args.seconds)
        nulls, null_cpu = measured(null, null_port, args.rate, args.seconds)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # a saturated server still draining its streams
                proc.kill()
                proc.wait()
    p50, p99 = quantiles(picks)
    h50, h99 = quantiles(baseline)
    n50, n99 = quantiles(nulls)
    pods = "peak-fit pods, admitting by curve" if args.peak else "pods"
    print(f"{len(picks)} requests at {args.rate:.0f}/s over {args.pods} {pods}, loopback")
    print(f"decision latency  p50 {p50:.3f} ms  p99 {p99:.3f} ms  (target p99 <= 1 ms)"
          f"  picker CPU {pick_cpu:.2f} ms a request")  # fmt: skip
    print(f"baseline: one Hold round trip  p50 {h50:.3f} ms  p99 {h99:.3f} ms")
    print(f"baseline: a null ext_proc server, {len(nulls)} requests  p50 {n50:.3f} ms  "
          f"p99 {n99:.3f} ms  its CPU {null_cpu:.2f} ms a request")  # fmt: skip
    if FAILURES:
        print(f"{len(FAILURES)} streams failed, e.g. {FAILURES[0]}")
    print(f"ratio decision / hold: p50 {p50 / h50:.2f}x  p99 {p99 / h99:.2f}x")
    print(f"ratio decision / null server: p50 {p50 / n50:.2f}x  p99 {p99 / n99:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
