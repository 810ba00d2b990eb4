"""`kvbank serve`: the engine behind its OpenAI-compatible HTTP API.

With no --model it serves the built-in random-weight Llama (built once into the user's cache);
with --tp N it starts N ranks under torch.distributed, rank 0 serving HTTP and deciding admission.
With KVBANK_WORLD_SIZE above 1 (or --world), as the operator renders for a tensor-parallel pool,
this process is one rank of a group spread over pods (kvbank.engine.tp.pod).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbank.engine.engine import RequestOutput
from kvbank.engine.serve.flags import add_arguments, options_from_args

if TYPE_CHECKING:  # torch, uvicorn and the model load only when serve runs
    import uvicorn

    from kvbank.engine.model.grammar import GrammarCompiler
    from kvbank.engine.serve.http.loop import EngineLoop
    from kvbank.engine.serve.stack import Stack

log = logging.getLogger("kvbank.serve")

__all__ = ["add_arguments", "build_server", "run", "serve_stack"]  # add_arguments: kvbank.cli


def build_server(
    stack: Stack,
    host: str,
    port: int,
    step_fn: Callable[[], list[RequestOutput]] | None = None,
    idle_fn: Callable[[], None] | None = None,
) -> tuple[uvicorn.Server, EngineLoop]:
    """The HTTP server and the engine loop over `stack`; neither is started."""
    import uvicorn

    from kvbank.engine.serve.http.app import Served, create_app
    from kvbank.engine.serve.http.auth import read_api_keys
    from kvbank.engine.serve.http.deadline import ConnectionLimits, DeadlineProtocol
    from kvbank.engine.serve.http.limits import Server, connection_cap, raise_open_files_limit
    from kvbank.engine.serve.http.loop import EngineLoop
    from kvbank.engine.serve.http.metrics import ServeMetrics

    options = stack.options
    metrics = ServeMetrics(stack.options.pages, stack.options.page_size)
    metrics.meter_recompute(stack.engine)
    loop = EngineLoop(
        stack.engine, stack.options.max_waiting, metrics.observe_step, step_fn, idle_fn
    )
    served = Served(
        options.served_model_name or stack.name,
        stack.tokenizer,
        stack.config.vocab_size,
        stack.capacity.max_seq_len,
        stack.capacity.max_tokens,
        extra_stop_ids(stack),
        root=str(stack.model_dir),
        max_body_bytes=options.max_body_bytes,
        api_keys=read_api_keys(options.api_key_file) if options.api_key_file else frozenset(),
        grammars=grammar_compiler(stack),
    )
    app = create_app(served, loop, metrics)
    open_files = raise_open_files_limit()
    limits = ConnectionLimits(
        options.header_timeout_s,
        options.body_timeout_s,
        options.write_timeout_s,
        options.max_body_bytes,
        options.max_connections or connection_cap(open_files),
    )
    if limits.max_connections is not None and limits.max_connections > open_files:
        log.warning(
            "--max-connections %d is over the open-files limit of %d: a flood of connections "
            "can take the descriptors the model and the sidecar need",
            limits.max_connections, open_files,
        )  # fmt: skip
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        http=DeadlineProtocol.factory(limits),
    )
    return Server(config), loop


def grammar_compiler(stack: Stack) -> GrammarCompiler | None:
    """llguidance over the served tokenizer, handed to rank 0's sampler too; None when the
    model has no end-of-text token to finish a grammar with, or llguidance is not installed."""
    eos = stack.tokenizer.eos_token_id
    if eos is None and stack.config.eos_token_ids:
        eos = stack.config.eos_token_ids[0]
    try:
        from kvbank.engine.model.grammar import GrammarCompiler
    except ImportError:
        log.warning("llguidance is not installed: response_format json_schema is refused")
        return None
    if eos is None:
        return None
    compiler = GrammarCompiler(stack.tokenizer.to_json(), eos)
    stack.runner.sampler.grammars = compiler
    return compiler


def extra_stop_ids(stack: Stack) -> tuple[int, ...]:
    """config.json's end-of-text ids other than the one the engine stops at itself."""
    engine_eos = stack.tokenizer.eos_token_id
    if engine_eos is None and stack.config.eos_token_ids:
        engine_eos = stack.config.eos_token_ids[0]
    return tuple(t for t in stack.config.eos_token_ids if t != engine_eos)


def serve_stack(
    stack: Stack,
    host: str,
    port: int,
    step_fn: Callable[[], list[RequestOutput]] | None = None,
    idle_fn: Callable[[], None] | None = None,
) -> int:
    """Run the HTTP server over `stack` until interrupted; 1 when the engine loop failed."""
    server, loop = build_server(stack, host, port, step_fn, idle_fn)
    loop.start()
    log.info(
        "serving %s on http://%s:%d (%s attention, %d pages of %d tokens, policy %s)",
        stack.name, host, port, stack.attention, stack.options.pages, stack.options.page_size,
        stack.options.policy,
    )  # fmt: skip
    failed = _run_until_loop_fails(server, loop)
    loop.stop()
    return 1 if failed or loop.error is not None else 0


def _run_until_loop_fails(server: uvicorn.Server, loop: EngineLoop) -> bool:
    """uvicorn's run, plus a watcher that stops the server when the engine loop dies (a fatal
    engine error, or a tensor-parallel peer lost): the process then exits non-zero."""
    import threading

    stopped_by_loop = threading.Event()

    def watcher() -> None:
        while not server.should_exit:
            if loop.error is not None:
                stopped_by_loop.set()
                server.should_exit = True
                return
            time.sleep(0.1)

    threading.Thread(target=watcher, name="loop-watcher", daemon=True).start()
    # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, to whatever handler was
    # there before: with a no-op one the process returns normally (exit 0, and under TP rank 0
    # still tells its followers to stop).
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    return stopped_by_loop.is_set()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        options = options_from_args(args)
        from kvbank.engine.tp.pod import pod_rank

        place = pod_rank(args.rank, args.world, args.master, os.environ)
        if place is not None:
            if args.tp > 1:
                raise ValueError(
                    f"--tp {args.tp} starts every rank here, but {place.world_source}="
                    f"{place.world} makes this process one rank of a group across pods: "
                    f"drop --tp, or unset {place.world_source}"
                )
            from kvbank.engine.tp.launch import DEFAULT_TIMEOUT_S
            from kvbank.engine.tp.pod import run_pod_rank

            return run_pod_rank(place, options, args.host, args.port, DEFAULT_TIMEOUT_S)
        if args.tp > 1:
            from kvbank.engine.tp.launch import run_tp

            return run_tp(options, args.tp, args.host, args.port)
        from kvbank.engine.serve.stack import build_stack

        stack = build_stack(options)
    except ValueError as exc:
        print(f"kvbank serve: {exc}", file=sys.stderr)
        return 2
    return serve_stack(stack, args.host, args.port)
