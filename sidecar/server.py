"""`kvbank sidecar`: the gRPC admission service beside one engine (rank 0 of a TP group).

    kvbank sidecar --listen 127.0.0.1:50051 --metrics-port 9464 [--pool FILE]

Loopback by default. Followers in other pods need `--listen` on the pod address, and then the
server insists on a shared token (`--token-file`) and on TLS (`--tls-cert-file`,
`--tls-key-file`), so the token never crosses the pod network in the clear; `--trusted-network`
waives TLS where the network itself is private. SIGTERM stops it gracefully: health turns
NOT_SERVING, calls in flight get `--grace-s` seconds, then the process exits 0.

`--listen` given twice serves one ledger on both: a rank pod's sidecar listens on the pod
address, for the operator's status reads and the kubelet's probes, and on a Unix socket in a
volume its engine mounts too, so the engine's calls never touch the network stack.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from kvbank.capacity import holdability, pool_pages
from kvbank.manifests import ManifestError
from kvbank.mode import LEDGER_MODE_NAMES
from kvbank.poolfile import PoolFileError, read_pool
from kvbank.proto import admission_pb2 as pb
from kvbank.proto import admission_pb2_grpc as pb_grpc
from kvbank.sidecar.auth import TokenInterceptor
from kvbank.sidecar.decision_log import DecisionLog
from kvbank.sidecar.reports import DEFAULT_MAX_WAITING
from kvbank.sidecar.routing import RoutingService, RoutingView
from kvbank.sidecar.service import AdmissionService
from kvbank.sidecar.state import AdmissionState

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admission"].full_name
ROUTING_NAME = pb.DESCRIPTOR.services_by_name["Routing"].full_name
DEFAULT_LISTEN = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        action="append",
        help="HOST:PORT (port 0: any), or unix:///PATH for a Unix socket (the pod's own ranks "
        "over a shared volume); again to serve on both, e.g. the pod address for the operator "
        "and the probes and a socket for the engine beside it "
        f"(default: {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9464, help="Prometheus port (0: any, -1: off)"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus listen address")
    parser.add_argument(
        "--pool",
        metavar="FILE",
        help="ModelPool manifest this sidecar serves; one `kvbank check` refuses is refused here",
    )
    parser.add_argument(
        "--policy",
        choices=sorted(LEDGER_MODE_NAMES),
        help="the ledger's admission policy (default: the --pool's spec.admission, else the "
        "policy the engine asks for); an engine that asks for another gets FAILED_PRECONDITION",
    )
    parser.add_argument("--token-file", help="file holding the shared token callers must send")
    parser.add_argument(
        "--tls-cert-file", metavar="PATH", help="PEM server certificate (with --tls-key-file)"
    )
    parser.add_argument("--tls-key-file", metavar="PATH", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--trusted-network",
        action="store_true",
        help="allow a non-loopback --listen with --token-file but no TLS (the network is private)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests the ledger queues at most; a submit past it gets RESOURCE_EXHAUSTED "
        "(keep it above the engine's own --max-waiting)",
    )
    parser.add_argument(
        "--lease-s", type=float, default=10.0, help="default engine lease, in seconds"
    )
    parser.add_argument(
        "--follower-timeout-s",
        type=float,
        default=30.0,
        help="a follower silent this long stops holding the decision log",
    )
    parser.add_argument("--log-max", type=int, default=65536, help="decision log entries kept")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=1 << 20,
        help="largest gRPC message accepted; a larger one gets RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--grace-s", type=float, default=5.0, help="shutdown grace period, in seconds"
    )
    parser.add_argument("--debug", action="store_true", help="check the ledger after reports")


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Config:
    listen: tuple[str, ...]  # one server on each; the first one's port is the one reported
    metrics_port: int
    metrics_host: str
    pool_pages: int | None
    token: str | None
    tls: tuple[bytes, bytes] | None
    lease_s: float
    follower_timeout_s: float
    log_max: int
    max_message_bytes: int
    grace_s: float
    debug: bool
    policy: str | None = None  # None: the engine's (no pool, no --policy)
    max_waiting: int = DEFAULT_MAX_WAITING
    worst_request_pages: int | None = None  # the --pool's worst-case request, for pickers


def _read_pool(path: str) -> tuple[int, str, int]:
    """The pool's pages, the ledger policy its spec.admission names and its worst-case
    request's pages."""
    try:
        pool = read_pool(path, "this sidecar")
    except PoolFileError as exc:
        raise ConfigError(str(exc)) from exc
    return pool_pages(pool), pool.admission.mode.name, holdability(pool).worst_request_pages


# A Unix socket's path must fit `sockaddr_un.sun_path` (108 bytes with its terminating NUL).
UNIX_PATH_MAX = 107


def unix_path(listen: str) -> Path | None:
    """The socket path of a `unix:PATH` or `unix:///PATH` address; None for HOST:PORT."""
    if not listen.startswith("unix:"):
        return None
    rest = listen[len("unix:") :]
    return Path(rest[2:] if rest.startswith("//") else rest)


def check_unix(listen: str) -> None:
    """A Unix socket needs a path the kernel takes, in a folder that exists; a file left there
    by a sidecar that died is replaced, anything else is refused."""
    path = unix_path(listen)
    if path is None:
        return
    if listen.endswith("/") or str(path) in ("", "."):
        raise ConfigError(f"--listen {listen[:120]!r}: give the socket's file, unix:///PATH")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(
            f"--listen: the socket path is {len(os.fsencode(path))} bytes; a Unix socket's "
            f"path is at most {UNIX_PATH_MAX}: use a shorter one"
        )
    if not path.parent.is_dir():
        raise ConfigError(f"--listen {listen[:120]}: the folder {path.parent} does not exist")
    if path.exists() and not path.is_socket():
        raise ConfigError(
            f"--listen {listen[:120]}: {path} exists and is not a socket; remove it or choose "
            "another path"
        )


def is_loopback(listen: str) -> bool:
    if unix_path(listen) is not None:
        return True  # reached only through the file system of its own pod
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_from_args(args: argparse.Namespace) -> Config:
    try:
        pages, pool_policy, worst = _read_pool(args.pool) if args.pool else (None, None, None)
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        tls = None
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            raise ConfigError(
                "--tls-cert-file and --tls-key-file go together; give both or neither"
            )
        if args.tls_cert_file:
            tls = (Path(args.tls_key_file).read_bytes(), Path(args.tls_cert_file).read_bytes())
    except (OSError, ManifestError) as exc:
        raise ConfigError(str(exc)) from exc
    if args.token_file and not token:
        raise ConfigError(f"--token-file {args.token_file} is empty")
    if args.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    listen = tuple(args.listen or [DEFAULT_LISTEN])
    for address in listen:
        check_unix(address)
        check_exposure(address, token is not None, tls is not None, args.trusted_network)
    return Config(
        listen=listen,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        pool_pages=pages,
        token=token,
        tls=tls,
        lease_s=args.lease_s,
        follower_timeout_s=args.follower_timeout_s,
        log_max=args.log_max,
        max_message_bytes=args.max_message_bytes,
        grace_s=args.grace_s,
        debug=args.debug,
        policy=getattr(args, "policy", None) or pool_policy,
        max_waiting=args.max_waiting,
        worst_request_pages=worst,
    )


def check_exposure(listen: str, token: bool, tls: bool, trusted_network: bool) -> None:
    """A listener other ranks reach over the pod network needs a token, and TLS so the token
    does not cross that network in the clear (unless the operator vouches for the network)."""
    if is_loopback(listen):
        return
    if not token:
        raise ConfigError(
            f"--listen {listen} is not a loopback address: give --token-file (and "
            "--tls-cert-file/--tls-key-file) so only the group's own ranks can reach the ledger"
        )
    if not tls and not trusted_network:
        raise ConfigError(
            f"--listen {listen} is not a loopback address and the token would cross the "
            "network in the clear: give --tls-cert-file and --tls-key-file, or "
            "--trusted-network if the network is private"
        )


async def serve(
    config: Config, stop: asyncio.Event, on_ready: Callable[[int], None] | None = None
) -> None:
    """Run until `stop` is set, then shut down within the grace period. `on_ready` gets the
    first listen address's bound port once the server accepts calls."""
    log = DecisionLog(config.log_max, config.follower_timeout_s)
    state = AdmissionState(
        config.pool_pages,
        log,
        config.debug,
        config.lease_s,
        policy=config.policy,
        max_waiting=config.max_waiting,
    )
    interceptors = [TokenInterceptor(config.token)] if config.token else []
    limit = config.max_message_bytes
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", limit)],
    )
    pb_grpc.add_AdmissionServicer_to_server(AdmissionService(state), server)
    routing = RoutingView(state, config.worst_request_pages)
    pb_grpc.add_RoutingServicer_to_server(RoutingService(routing), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # With TLS every listener serves it, the Unix socket too, as loopback TCP does: one set of
    # flags for the engine whichever address it is given.
    ports = [
        server.add_secure_port(address, grpc.ssl_server_credentials([config.tls]))
        if config.tls
        else server.add_insecure_port(address)
        for address in config.listen
    ]
    metrics_note = "off"
    http = None
    if config.metrics_port >= 0:
        http, _ = start_http_server(
            config.metrics_port, addr=config.metrics_host, registry=state.metrics.registry
        )
        metrics_note = f"{config.metrics_host}:{http.server_port}"
    await server.start()
    for name in ("", SERVICE_NAME, ROUTING_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    where = " and ".join(
        address if unix_path(address) is not None else f"{address.rsplit(':', 1)[0]}:{port}"
        for address, port in zip(config.listen, ports, strict=True)
    )
    print(f"kvbank sidecar: serving on {where}, metrics {metrics_note}", flush=True)
    if on_ready is not None:
        on_ready(ports[0])

    async def housekeeping() -> None:
        # Lease and follower checks at a tenth of the lease: a dead engine's reservations go
        # within 1.1 leases.
        while True:
            lease_s = state.session.lease_s if state.session else config.lease_s
            await asyncio.sleep(min(lease_s, config.follower_timeout_s) / 10)
            state.expire()
            log.expire_followers()

    async def hold_expiry() -> None:
        # Holds last seconds, leases tens of them: a hold goes within 50 ms of its ttl.
        while True:
            await asyncio.sleep(0.05)
            routing.expire()

    chores = [asyncio.create_task(housekeeping()), asyncio.create_task(hold_expiry())]
    try:
        await stop.wait()
    finally:
        for chore in chores:
            chore.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        if http is not None:
            http.shutdown()
            http.server_close()
        print("kvbank sidecar: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
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
        print(f"error: cannot serve on {' and '.join(config.listen)}: {exc}", file=sys.stderr)
        return 1
    return 0
