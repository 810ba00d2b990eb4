"""`kvbank serve --tp N`: N ranks under torch.distributed, rank 0 serving HTTP and deciding.

The launcher starts one process per rank (`python -m kvbank.engine.tp.launch`), each with its own
shard of the weights and its own KV pool of the same page count. Rank 0 runs the HTTP API and
admits through its ledger (embedded or its sidecar); followers replay rank 0's plan step by step
(see kvbank.engine.tp.sync). The process group has a timeout, so a lost peer or a divergence ends
every rank with a non-zero exit within seconds; the launcher then stops what is left.

Across pods there is no launcher: each pod's `kvbank serve` runs one rank (`run_rank`, placed by
kvbank.engine.tp.pod from the operator's environment), and a pod whose rank exits is restarted
by its workload.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from kvbank.engine.model.llama import Parallel
from kvbank.engine.serve.stack import ServeOptions
from kvbank.engine.tp.sync import (
    IDLE,
    NO_ROWS,
    Added,
    Channel,
    FollowerBackend,
    FollowerRunner,
    LeaderRunner,
    Plan,
    RecordingBackend,
)
from kvbank.mode import LEDGER_MODE_NAMES

log = logging.getLogger("kvbank.tp")

DEFAULT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 600.0  # starting a rank and loading its shard of a large checkpoint
GRACE_S = 15.0  # how long the launcher waits for ranks to exit on their own after a failure


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_command(
    rank: int,
    world: int,
    master: str,
    options: ServeOptions,
    host: str,
    port: int,
    timeout_s: float,
) -> list[str]:
    return [
        sys.executable, "-m", "kvbank.engine.tp.launch",
        "--rank", str(rank), "--world", str(world), "--master", master,
        "--host", host, "--port", str(port), "--timeout", str(timeout_s),
        "--options", json.dumps(dataclasses.asdict(options)),
    ]  # fmt: skip


def run_tp(
    options: ServeOptions, world: int, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> int:
    """Start every rank and wait. Non-zero when any rank fails; the others are stopped. Raises
    ValueError, before starting anything, when the model's heads cannot be split `world` ways
    or the sidecar (`--sidecar`) does not answer or refuses the token."""
    from kvbank.engine.model.config import load_config
    from kvbank.engine.serve.stack import check_sidecar, resolve_model_dir

    if options.sidecar:  # a wrong token or certificate ends start-up here, not in rank 0
        check_sidecar(options)
    # Resolving builds the built-in model once, here, before the ranks would race for it.
    _, model_dir = resolve_model_dir(options)
    Parallel(0, world).check(load_config(model_dir))
    master = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(rank_command(r, world, master, options, host, port, timeout_s))
        for r in range(world)
    ]
    pids = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(procs))
    log.info("tensor-parallel ranks started: %s", pids)

    def stop(signum: int, _frame: object) -> None:
        # Rank 0 shuts down cleanly and tells the followers; wait_for_ranks kills stragglers.
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return wait_for_ranks(procs)


def wait_for_ranks(procs: list[subprocess.Popen[bytes]]) -> int:
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    deadline = time.monotonic() + GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for r, proc in enumerate(procs):
        if proc.poll() is None:
            log.error("rank %d did not exit after its peer stopped; killing it", r)
            proc.kill()
            proc.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        log.error("tensor-parallel group failed: %s",
                  ", ".join(f"rank {r} exit {code}" for r, code in failed))  # fmt: skip
        return 1
    return 0


# ---- one rank ---------------------------------------------------------------------------------


def rank_main(rank: int, world: int, master: str, options: ServeOptions, host: str, port: int,
              timeout_s: float, pod: bool = False) -> int:  # fmt: skip
    """Run one rank until its group ends. `pod`: this rank has a pod (kvbank.engine.tp.pod) of
    its own rather than a process beside the others, so it drives its pod's only GPU (cuda:0,
    not cuda:rank) and a follower serves /health on `host:port` itself."""
    import torch.distributed as dist

    addr, master_port = master.rsplit(":", 1)
    device = options.device or ("cuda" if _cuda() else "cpu")
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    # Two clocks: ranks may take long and unequal times to start and load weights (the store's
    # STARTUP_TIMEOUT_S), but once serving, any collective that waits past `timeout_s` means a
    # peer is gone or diverged and ends the rank.
    store = dist.TCPStore(addr, int(master_port), world, rank == 0,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))  # fmt: skip
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    channel = Channel(rank, world, lambda: _all_loaded(store, rank, world))
    parallel = Parallel(rank, world)
    device_index = 0 if pod else None
    if rank == 0:
        return _leader(options, parallel, channel, host, port, device_index)
    http = (host, port, addr) if pod else None
    return _follower(options, parallel, channel, device_index, http)


def _all_loaded(store: Any, rank: int, world: int) -> None:
    """Wait, on the store's long clock, until every rank has loaded its weights."""
    store.set(f"loaded/{rank}", "1")
    store.wait([f"loaded/{r}" for r in range(world)])


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _leader(
    options: ServeOptions,
    parallel: Parallel,
    channel: Channel,
    host: str,
    port: int,
    device_index: int | None,
) -> int:
    from kvbank.engine.serve.command import serve_stack
    from kvbank.engine.serve.stack import build_stack, options_sidecar_backend
    from kvbank.ledger.client import embedded

    # The followers replay rank 0's backend, under every ledger policy, its own or its
    # sidecar's: each answer it gave is recorded for the step's plan.
    recording = None
    if options.policy in LEDGER_MODE_NAMES:
        inner = (options_sidecar_backend(options) if options.sidecar
                 else embedded(options.pages, debug=options.debug))  # fmt: skip
        recording = RecordingBackend(inner)
    stack = build_stack(options, parallel, recording, device_index=device_index)
    channel.startup_barrier()
    engine = stack.engine
    journal: list[Any] = []
    seq = [0]

    def make_plan(kind: str, message: str = "") -> Plan:
        plan = Plan(seq[0], kind, list(journal), recording.take_polls() if recording else [],
                    message)  # fmt: skip
        seq[0] += 1
        journal.clear()
        return plan

    _journal_requests(engine, journal)
    runner = LeaderRunner(stack.runner, channel, make_plan)
    engine.runner = runner

    def step() -> list[Any]:
        runner.synced = False
        try:
            outputs = engine.step()
        except Exception as exc:
            if not runner.synced:  # tell the followers before stopping, so none waits
                channel.broadcast(make_plan("error", f"rank 0 failed: {exc}"))
            raise
        if not runner.synced:
            plan = make_plan("step")
            channel.broadcast(plan)
            channel.agree(NO_ROWS, plan.seq)
        return list(outputs)

    def heartbeat() -> None:
        plan = make_plan("idle")
        channel.broadcast(plan)
        channel.agree(IDLE, plan.seq)

    code = serve_stack(stack, host, port, step, heartbeat)
    if code == 0:  # a clean shutdown: let the followers go too
        with contextlib.suppress(RuntimeError):
            channel.broadcast(make_plan("stop"))
    return code


def _journal_requests(engine: Any, journal: list[Any]) -> None:
    """Record rank 0's adds and aborts, in order, for the next plan. The engine loop calls
    these between steps; wrapping the bound methods keeps the engine core unaware of TP."""
    add, abort = engine.add_request, engine.abort

    def add_request(rid: str, prompt: list[int], max_tokens: int | None = None, **kw: Any) -> Any:
        req = add(rid, prompt, max_tokens, **kw)
        siblings = tuple(kw.get("siblings", ()))
        journal.append(
            Added(rid, list(prompt), max_tokens, kw.get("sampling"), siblings,
                  kw.get("service_class"))
        )  # fmt: skip
        return req

    def abort_request(rid: str) -> bool:
        done = bool(abort(rid))
        if done:
            journal.append(rid)
        return done

    engine.add_request = add_request
    engine.abort = abort_request


def _follower(
    options: ServeOptions,
    parallel: Parallel,
    channel: Channel,
    device_index: int | None,
    http: tuple[str, int, str] | None,
) -> int:
    """Replay rank 0's plans. `http` (host, port, rank 0's host): serve /health there once
    loaded, as a pod's follower must for its readiness probe."""
    from kvbank.engine.serve.stack import build_stack

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 says when to stop
    backend: Any = None
    if options.policy in LEDGER_MODE_NAMES:
        backend = FollowerBackend(late=bool(options.sidecar))
    # Decisions come from rank 0's plans over the process group, not from a sidecar: a pod's
    # own sidecar, rendered beside every rank, is not asked (see docs/operator.md).
    follower_options = dataclasses.replace(options, sidecar=None)
    stack = build_stack(follower_options, parallel, backend, device_index=device_index)
    channel.startup_barrier()
    if http is not None:
        from kvbank.engine.tp.pod import serve_follower_http

        serve_follower_http(http[0], http[1], parallel.rank, parallel.world, http[2])
    engine = stack.engine
    runner = FollowerRunner(stack.runner, channel)
    engine.runner = runner
    expected = 0
    while True:
        plan = channel.broadcast(None)
        if plan.seq != expected:
            raise RuntimeError(f"plan {plan.seq} arrived, {expected} was expected")
        expected += 1
        if plan.kind == "stop":
            return 0
        if plan.kind == "error":
            log.error("rank %d stops: %s", parallel.rank, plan.message)
            return 1
        error = None
        try:
            for entry in plan.journal:
                if isinstance(entry, Added):
                    engine.add_request(entry.rid, entry.prompt, entry.max_tokens,
                                       sampling=entry.sampling,
                                       siblings=entry.siblings,
                                       service_class=entry.service_class)  # fmt: skip
                else:
                    engine.abort(entry)
            if backend is not None:
                backend.expect(plan.polls)
            runner.synced = False
            runner.seq = plan.seq
            if plan.kind == "step":
                engine.step()
        except Exception as exc:
            if runner.synced:
                raise
            error = f"error on rank {parallel.rank}: {exc}"
        if not runner.synced:
            channel.agree(error or (IDLE if plan.kind == "idle" else NO_ROWS), plan.seq)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of kvbank serve")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--options", required=True, help="ServeOptions as JSON")
    args = parser.parse_args(argv)
    log_format = f"%(asctime)s %(levelname)s rank {args.rank} %(name)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    options = ServeOptions(**json.loads(args.options))
    return run_rank(args.rank, args.world, args.master, options, args.host, args.port,
                    args.timeout)  # fmt: skip


def run_rank(rank: int, world: int, master: str, options: ServeOptions, host: str, port: int,
             timeout_s: float, pod: bool = False) -> int:  # fmt: skip
    """rank_main as a process's last act: any failure is logged and the process exits with the
    rank's code."""
    try:
        code = rank_main(rank, world, master, options, host, port, timeout_s, pod)
    except Exception as exc:
        log.error("rank %d stops: %s", rank, exc)
        code = 1
    _exit(code)
    return code


def _exit(code: int) -> None:
    # os._exit: a process group whose peer is gone can hang in its destructor; the rank's
    # outcome is decided, so nothing is left to flush but the logs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
