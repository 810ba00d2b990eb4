"""Pod mode of `kvbank serve`: this process is one rank of a tensor-parallel group whose ranks
run in separate pods, placed by the environment the operator renders.

    KVBANK_WORLD_SIZE  ranks in the group (`--world`); above 1 turns pod mode on
    KVBANK_RANK        this pod's rank, 0 to world - 1 (`--rank`)
    KVBANK_RANK0_ADDR  host name of the group's rank-0 pod (`--master HOST:PORT` overrides it
    KVBANK_DIST_PORT   and this port, default 29500, together)

Every rank joins torch.distributed at rank 0's address and runs `kvbank.engine.tp.launch.rank_main`,
exactly as `kvbank serve --tp N` runs its in-process ranks: rank 0 serves the API and decides
admission, followers replay its plans over the process group. A follower also listens on its own
HTTP port, because the operator's readiness probe asks every engine container for /health; every
other path there answers 421 naming rank 0, so a client that reaches a follower learns where to go.

A bad placement (a rank outside the group, no rank-0 address, a size that cannot split the
model's heads) is refused before anything starts, naming the variable (or flag) to fix: a pod
that waited ten minutes in a store for a peer that can never join would hide the mistake.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only once a rank runs
    from kvbank.engine.serve.stack import ServeOptions

ENV_RANK = "KVBANK_RANK"
ENV_WORLD = "KVBANK_WORLD_SIZE"
ENV_RANK0 = "KVBANK_RANK0_ADDR"
ENV_DIST_PORT = "KVBANK_DIST_PORT"
DEFAULT_DIST_PORT = 29500

log = logging.getLogger("kvbank.tp")


@dataclass(frozen=True)
class PodRank:
    """Where this process sits in its group, and the names its figures came from (a flag or an
    environment variable), so an error names what the operator of the pod has to change."""

    rank: int
    world: int
    master: str  # HOST:PORT of rank 0's torch.distributed store
    rank_source: str = ENV_RANK
    world_source: str = ENV_WORLD

    @property
    def rank0_host(self) -> str:
        return self.master.rsplit(":", 1)[0]


def _integer(value: str, name: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set it to {what}") from None


def pod_rank(
    rank: int | None, world: int | None, master: str | None, environ: Mapping[str, str]
) -> PodRank | None:
    """This process's place from the flags, each defaulting to its environment variable. None
    when the group has one rank: a plain single engine. Raises ValueError naming what to fix."""
    world_source = "--world" if world is not None else ENV_WORLD
    if world is None:
        text = environ.get(ENV_WORLD, "").strip()
        world = _integer(text, ENV_WORLD, "the pool's tensorParallel") if text else 1
    if world < 1:
        raise ValueError(f"{world_source}={world}: a group has at least 1 rank")
    rank_source = "--rank" if rank is not None else ENV_RANK
    if rank is None:
        text = environ.get(ENV_RANK, "").strip()
        if text:
            rank = _integer(text, ENV_RANK, f"this pod's rank, 0 to {world - 1}")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(
            f"{rank_source}={rank} is outside a group of {world_source}={world}: ranks run from "
            f"0 to {world - 1}; fix {rank_source} (or {world_source}, the pool's tensorParallel)"
        )
    if world == 1:
        return None
    if rank is None:
        raise ValueError(
            f"{world_source}={world} asks for one rank of a tensor-parallel group, but {ENV_RANK} "
            f"is not set: set it (or --rank) to this pod's rank, 0 to {world - 1}"
        )
    return PodRank(rank, world, _master(master, environ), rank_source, world_source)


def _master(master: str | None, environ: Mapping[str, str]) -> str:
    if master is not None:
        given_host, _, given_port = master.rpartition(":")
        if not given_host or not given_port.isdigit():
            raise ValueError(f"--master {master!r}: give rank 0's HOST:PORT")
        return master
    host = environ.get(ENV_RANK0, "").strip()
    if not host:
        raise ValueError(
            f"{ENV_RANK0} is not set: set it to the host name of the group's rank-0 pod (the "
            f"operator renders it), or give --master HOST:PORT"
        )
    port_text = environ.get(ENV_DIST_PORT, "").strip()
    port = DEFAULT_DIST_PORT
    if port_text:
        port = _integer(port_text, ENV_DIST_PORT, "rank 0's torch.distributed port")
    if not 0 < port < 65536:
        raise ValueError(f"{ENV_DIST_PORT}={port} is not a TCP port; set it to 1-65535")
    return f"{host}:{port}"


def check_split(place: PodRank, options: ServeOptions) -> None:
    """Refuse, before joining the group, a size the model's heads cannot be split by. Only the
    config is read; loading weights first would make every rank wait for a group that fails."""
    from kvbank.engine.model.config import load_config
    from kvbank.engine.model.llama import Parallel
    from kvbank.engine.serve.stack import resolve_model_dir

    _, model_dir = resolve_model_dir(options)
    try:
        Parallel(place.rank, place.world).check(load_config(model_dir))
    except ValueError as exc:
        # Parallel.check speaks of --tp, the in-process flag; here the size came from elsewhere.
        reason = str(exc).replace("--tp", place.world_source)
        raise ValueError(
            f"{place.world_source}={place.world} cannot split {model_dir.name}: {reason} "
            f"(it is the pool's tensorParallel)"
        ) from None


def run_pod_rank(
    place: PodRank, options: ServeOptions, host: str, port: int, timeout_s: float
) -> int:
    """Check the placement, then run this rank until the group ends. Does not return once the
    group has started: the rank's process exits with its code (see
    kvbank.engine.tp.launch.run_rank)."""
    from kvbank.engine.tp.launch import run_rank

    check_split(place, options)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank {place.rank} %(name)s %(message)s",
        force=True,
    )
    log.info("pod rank %d of %d, rank 0's store at %s", place.rank, place.world, place.master)
    return run_rank(place.rank, place.world, place.master, options, host, port, timeout_s,
                    pod=True)  # fmt: skip


# ---- a follower's HTTP ------------------------------------------------------------------------


def misdirected_message(rank: int, world: int, rank0_host: str) -> str:
    return (
        f"this engine is rank {rank} of a {world}-rank tensor-parallel group; only rank 0 "
        f"({rank0_host}) serves the API. Send requests to the pool's Service, which selects "
        f"rank 0, or to rank 0 itself"
    )


def serve_follower_http(host: str, port: int, rank: int, world: int, rank0_host: str) -> Any:
    """/health (200 while this follower runs) and a 421 naming rank 0 for everything else, in a
    daemon thread: the follower's main thread is busy replaying rank 0's plans, and the process
    exits (taking this server with it) when the group ends. Returns the started server."""
    health = json.dumps({"status": "ok", "rank": rank, "world": world}).encode()
    refusal = json.dumps(
        {
            "error": {
                "message": misdirected_message(rank, world, rank0_host),
                "type": "misdirected_request",
                "param": None,
                "code": "not_rank_0",
            }
        }
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: bytes) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)  # drain it, so the client is not reset mid-send
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # http.server's naming
            if self.path.split("?", 1)[0] in ("/health", "/health/live"):
                self._answer(200, health)
            else:
                self._answer(421, refusal)

        def do_POST(self) -> None:
            self._answer(421, refusal)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a readiness probe every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="follower-http", daemon=True).start()
    log.info("rank %d serves /health on http://%s:%d; the API is rank 0's", rank, host, port)
    return server
