"""`kvbank picker`: an Endpoint Picker for a Gateway API InferencePool (docs/routing.md).

    kvbank picker --pool pool.yaml --model-dir /models/llama \\
        --pod 10.0.0.5:8000=10.0.0.5:50051 --pod 10.0.0.6:8000=10.0.0.6:50051
    kvbank picker --pool pool.yaml --model-dir /models/llama \\
        --selector kvbank.dev/pool=llama --namespace team-a   # the Ready pods, from Kubernetes

Serves Envoy's `ext_proc` on `--listen` (GAIE's port 9002 by default) and gRPC health with the
protocol's services: `liveness` (the process answers), `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` (every pod's first watch has answered or failed,
so the candidates are known). Several replicas may run: their holds on the pods' sidecars keep
two picks from taking the same room. SIGTERM: health turns NOT_SERVING, streams in flight get
`--grace-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from kvbank.picker.body import DEFAULT_MAX_BODY_BYTES, Counter
from kvbank.picker.discovery import Discovery, Target
from kvbank.picker.extproc import ExternalProcessor, Settings
from kvbank.picker.kube import PodApi
from kvbank.picker.lobby import DEFAULT_MAX_HOLD_S
from kvbank.picker.metrics import PickerMetrics
from kvbank.picker.sidecars import Link, Pod, Sidecars
from kvbank.poolfile import PoolFileError, read_pool

EXT_PROC = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
READY_SERVICES = ("", "readiness", EXT_PROC)
DEFAULT_LISTEN = "0.0.0.0:9002"
MAX_HOLD_LIMIT_S = 3600.0  # a request held longer is lost to its client's own timeout anyway


class ConfigError(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT of the ext_proc server")
    parser.add_argument(
        "--pod",
        action="append",
        default=[],
        metavar="IP:PORT=SIDECAR",
        help="a pod of the pool: the endpoint the gateway sends to, and its sidecar's "
        "HOST:PORT; again for each pod (or find them with --selector)",
    )
    parser.add_argument(
        "--selector",
        metavar="LABELS",
        help="find the pods in Kubernetes instead: the Ready Pods this label selector matches "
        "(the InferencePool's spec.selector, e.g. kvbank.dev/pool=llama,kvbank.dev/rank=0)",
    )
    parser.add_argument("--namespace", help="the pods' namespace (default: the picker's own)")
    parser.add_argument(
        "--target-port", type=int, default=8000, help="with --selector: the engine's port"
    )
    parser.add_argument(
        "--sidecar-port", type=int, default=50051, help="with --selector: the sidecar's port"
    )
    parser.add_argument("--kubeconfig", help="with --selector, outside a pod: the kubeconfig")
    parser.add_argument("--pool", required=True, metavar="FILE", help="the pool's ModelPool")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-dir", help="the model folder whose tokenizer.json the pods use")
    model.add_argument(
        "--builtin-model", action="store_true", help="the built-in model's tokenizer"
    )
    parser.add_argument("--served-model-name", help="the model name requests must carry")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (-1: off)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="Prometheus listen address")
    parser.add_argument("--sidecar-token-file", help="the pods' sidecar token")
    parser.add_argument("--sidecar-ca-file", help="PEM CA of the sidecars' certificates")
    parser.add_argument(
        "--hold-ttl-s", type=float, default=5.0, help="a hold lasts this long without a submit"
    )
    parser.add_argument(
        "--max-hold-s",
        type=float,
        default=DEFAULT_MAX_HOLD_S,
        help="hold a strict request no pod admits now for up to this long, until one does; "
        "then it queues where it starts soonest (0: queue at once). The gateway's ext_proc "
        "message timeout must be longer",
    )
    parser.add_argument(
        "--loss-after-s",
        type=float,
        default=0.75,
        help="a pod whose sidecar sends nothing this long leaves the candidates",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="a request body over this many bytes gets 413 (the engine's own limit by default)",
    )
    parser.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace, seconds")


@dataclass(frozen=True)
class Config:
    listen: str
    pods: tuple[Pod, ...]
    target: Target | None  # find the pods in Kubernetes (then `pods` is empty)
    counter: Counter
    link: Link
    metrics_port: int
    metrics_host: str
    hold_ttl_s: float
    max_hold_s: float
    max_body_bytes: int
    grace_s: float
    kubeconfig: str | None = None


def parse_pod(text: str) -> Pod:
    endpoint, sep, sidecar = text.partition("=")
    host, colon, port = endpoint.rpartition(":")
    if not sep or not colon or not host or not port.isdigit() or ":" not in sidecar:
        raise ConfigError(
            f"--pod {text[:120]!r}: give IP:PORT=SIDECAR_HOST:PORT, e.g. "
            "10.0.0.5:8000=10.0.0.5:50051"
        )
    return Pod(endpoint, sidecar)


SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_namespace(given: str | None) -> str:
    if given:
        return given
    try:
        return SA_NAMESPACE.read_text().strip()
    except OSError:
        raise ConfigError(
            "--selector needs --namespace outside a pod (no ServiceAccount namespace to read)"
        ) from None


def config_from_args(args: argparse.Namespace) -> Config:
    from kvbank.engine.model.tokenizer import Tokenizer  # only the picker pays for it

    if not args.pod and not args.selector:
        raise ConfigError(
            "give the pool's pods with --pod IP:PORT=SIDECAR (once for each), or find them in "
            "Kubernetes with --selector LABELS"
        )
    if args.pod and args.selector:
        raise ConfigError("give the pods with --pod or find them with --selector, not both")
    target = None
    if args.selector:
        ports = (args.target_port, args.sidecar_port)
        if not all(0 < p < 65536 for p in ports):
            raise ConfigError("--target-port and --sidecar-port must be ports (1-65535)")
        target = Target(own_namespace(args.namespace), args.selector, *ports)
    pods = tuple(parse_pod(p) for p in args.pod)
    if len({p.endpoint for p in pods}) != len(pods):
        raise ConfigError("a --pod endpoint is given twice; give each pod once")
    if args.max_body_bytes < 1 or args.hold_ttl_s <= 0 or args.loss_after_s <= 0:
        raise ConfigError("--max-body-bytes, --hold-ttl-s and --loss-after-s must be positive")
    if not 0 <= args.max_hold_s <= MAX_HOLD_LIMIT_S:  # NaN too
        raise ConfigError(
            f"--max-hold-s must be between 0 (hold nothing) and {MAX_HOLD_LIMIT_S:g} seconds, "
            f"not {args.max_hold_s:g}"
        )
    try:
        served = read_pool(args.pool, "the picker")
        model = served.capacity_model()
    except (PoolFileError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    if args.builtin_model:
        from kvbank.engine.model.builtin import builtin_model_dir

        model_dir = builtin_model_dir()
    else:
        model_dir = Path(args.model_dir)
    try:
        tokenizer = Tokenizer(model_dir)
        token = (
            Path(args.sidecar_token_file).read_text().strip() if args.sidecar_token_file else None
        )
        ca = Path(args.sidecar_ca_file).read_bytes() if args.sidecar_ca_file else None
    except OSError as exc:
        raise ConfigError(str(exc)) from exc
    pool = served.pool
    counter = Counter(model, served.pages, tokenizer, args.served_model_name,
                      pool.admission.default_class, pool.limits.max_tokens)  # fmt: skip
    heartbeat = min(0.25, args.loss_after_s / 3)
    link = Link(token=token, ca_pem=ca, heartbeat_s=heartbeat, loss_after_s=args.loss_after_s)
    return Config(
        listen=args.listen,
        pods=pods,
        target=target,
        counter=counter,
        link=link,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        hold_ttl_s=args.hold_ttl_s,
        max_hold_s=args.max_hold_s,
        max_body_bytes=args.max_body_bytes,
        grace_s=args.grace_s,
        kubeconfig=args.kubeconfig,
    )


def pods_text(config: Config) -> str:
    t = config.target
    if t is None:
        return f"{len(config.pods)} pods"
    return f"the Ready pods of {t.selector} in {t.namespace}"


async def serve(
    config: Config,
    stop: asyncio.Event,
    on_ready: Callable[[int], None] | None = None,
    pod_api: Callable[[], PodApi] | None = None,
) -> None:
    """`pod_api` makes the Kubernetes client discovery uses (tests give their own)."""
    metrics = PickerMetrics()
    sidecars = Sidecars(list(config.pods), config.link, metrics)
    settings = Settings(config.counter, config.max_body_bytes, config.hold_ttl_s, config.max_hold_s)
    limit = config.max_body_bytes + (1 << 16)  # one chunk may carry the whole body
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    ep_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(settings, sidecars, metrics), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.listen)
    http = None
    if config.metrics_port >= 0:
        http, _ = start_http_server(
            config.metrics_port, addr=config.metrics_host, registry=metrics.registry
        )
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in READY_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    discovery = None
    if config.target is not None:
        from kvbank.picker.kube import KubePodApi

        discovery = Discovery(pod_api() if pod_api else KubePodApi(config.kubeconfig),
                              config.target, sidecars)  # fmt: skip
        discovery.start()
    sidecars.start()
    await server.start()
    print(f"kvbank picker: serving ext_proc on {config.listen.rsplit(':', 1)[0]}:{port} for "
          f"{pods_text(config)}", flush=True)  # fmt: skip

    async def readiness() -> None:
        while not sidecars.synced:
            await asyncio.sleep(0.02)
        for name in READY_SERVICES:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    ready = asyncio.create_task(readiness())
    if on_ready is not None:
        on_ready(port)
    try:
        await stop.wait()
    finally:
        ready.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        if discovery is not None:
            await discovery.stop()
        await sidecars.close()
        if http is not None:
            http.shutdown()
            http.server_close()
        print("kvbank picker: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"error: cannot serve on {config.listen}: {exc}", file=sys.stderr)
        return 1
    return 0
