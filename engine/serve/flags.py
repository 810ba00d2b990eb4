"""`kvbank serve`'s flags, and the `ServeOptions` they give: each figure checked, and a
`--pool` manifest's figures applied first (a flag that contradicts the pool is refused)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvbank.engine.serve.classes import add_class_arguments, class_options
from kvbank.mode import DEFAULT_MODE, LEDGER_MODE_NAMES

if TYPE_CHECKING:
    from kvbank.engine.serve.stack import ServeOptions

# The policies whose ledger `kvbank sidecar` runs: the ledger's modes (kvbank/mode.py).
SIDECAR_POLICIES = LEDGER_MODE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model folder (default: the built-in model)")
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients send and /v1/models lists (default: kvbank-builtin, or the "
        "--model folder's name); a benchmark tool that loads its tokenizer by the model's id "
        "finds it when this is the folder's path",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--pool",
        metavar="FILE",
        help="ModelPool manifest to serve, the one `kvbank sidecar --pool` reads: the pool's "
        "pages, page size, limits and admission come from it (a flag that says otherwise is "
        "refused)",
    )
    parser.add_argument("--pages", type=int, default=1024, help="KV pages per rank, sink included")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--host-pages",
        type=int,
        default=0,
        help="pages of host memory per rank that keep evicted prefix pages for reload instead "
        "of recompute (default 0: no host tier)",
    )
    parser.add_argument("--max-seq-len", type=int, help="prompt + output limit (default: model's)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="output limit, and the budget of a request that sends none",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_MODE.name,
        help="admission policy: peak+backfill (the default), peak, banker, banker+backfill "
        "(these four also with --sidecar), or a baseline: optimistic, preempt, no-evict, ratio",
    )
    add_class_arguments(parser)
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="waiting requests beyond which the API answers 429",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="tokens one step computes (longer prompts are chunked)",
    )
    parser.add_argument(
        "--sidecar",
        metavar="ADDR",
        help="admit through the gRPC sidecar at ADDR (HOST:PORT, or unix:///PATH for a Unix "
        "socket) instead of in-process",
    )
    parser.add_argument(
        "--sidecar-token-file", help="file holding the token the sidecar expects (--sidecar)"
    )
    parser.add_argument(
        "--sidecar-ca-file",
        metavar="PATH",
        help="PEM CA bundle that signed the sidecar's certificate: reach it over TLS",
    )
    parser.add_argument(
        "--sidecar-tls-server-name",
        metavar="NAME",
        help="the name the sidecar's certificate must carry (default: the --sidecar host)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument(
        "--world",
        type=int,
        help="ranks of a group with one rank per pod (default: $KVBANK_WORLD_SIZE, else 1); "
        "above 1 this process runs only rank --rank",
    )
    parser.add_argument(
        "--rank", type=int, help="this process's rank in that group (default: $KVBANK_RANK)"
    )
    parser.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="rank 0's torch.distributed address (default: $KVBANK_RANK0_ADDR:$KVBANK_DIST_PORT, "
        "the port 29500 when unset)",
    )
    parser.add_argument(
        "--attention",
        choices=["torch", "flashinfer"],
        help="paged attention backend (default: flashinfer on CUDA, else torch)",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank on CPU; 0: torch's default"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of unseeded requests")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=2 << 20,
        help="largest request body; a larger one gets 413 before it is read (default: 2 MiB)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers (default: 10)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's body after its headers (default: 30)",
    )
    parser.add_argument(
        "--write-timeout-s",
        type=float,
        default=30.0,
        help="seconds a response may wait on a client that stopped reading it before the "
        "connection is dropped and its request aborted (default: 30)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        help="connections held at once; more get 503 and are closed (default: the open-files "
        "limit, raised to its hard limit at start, less 256 kept for the model and the sidecar)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="file of API keys, one a line (# comments): /v1/* then needs "
        "'Authorization: Bearer KEY'; /health and /metrics stay open",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="check every pool and ledger invariant after every step",
    )


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    from kvbank.engine.serve.stack import KV_LABEL, ServeOptions

    pool = None
    if args.pool:
        from kvbank.engine.serve.from_pool import apply_pool

        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        args = argparse.Namespace(**vars(args))  # the caller's namespace stays as parsed
        pool = apply_pool(args, {k: defaults.get_default(k) for k in vars(args)})

    for name in ("pages", "page_size", "max_tokens", "max_waiting", "max_batch_tokens", "tp"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {args.max_connections}")
    for name in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "write_timeout_s"):
        value = getattr(args, name)
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be above 0, got {value}")
    if args.api_key_file is not None:
        from kvbank.engine.serve.http.auth import read_api_keys

        read_api_keys(args.api_key_file)  # refuse a missing or empty file before loading
    if args.pages < 2:
        raise ValueError(f"--pages must be at least 2 (one is the sink page), got {args.pages}")
    if args.host_pages < 0:
        raise ValueError(
            f"--host-pages must be at least 0 (0: no host tier), got {args.host_pages}"
        )
    from kvbank.engine.admission.registry import policy_names

    if args.policy not in policy_names():
        raise ValueError(
            f"--policy {args.policy!r} is not an admission policy; choose one of "
            f"{', '.join(policy_names())}"
        )
    if args.sidecar and args.policy not in SIDECAR_POLICIES:
        raise ValueError(
            f"--sidecar keeps the ledger in the sidecar, which runs the ledger of "
            f"{', '.join(SIDECAR_POLICIES)}; --policy {args.policy} keeps its own books "
            f"in-process. Use one of those with --sidecar, or drop --sidecar."
        )
    return ServeOptions(
        model=args.model,
        pages=args.pages,
        page_size=args.page_size,
        host_pages=args.host_pages,
        max_seq_len=args.max_seq_len,
        max_tokens=args.max_tokens,
        policy=args.policy,
        attention=args.attention,
        device=args.device,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        max_waiting=args.max_waiting,
        threads=args.threads or None,
        sidecar=args.sidecar,
        sidecar_token_file=args.sidecar_token_file,
        sidecar_ca_file=args.sidecar_ca_file,
        sidecar_tls_server_name=args.sidecar_tls_server_name,
        debug=args.debug,
        seed=args.seed,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        write_timeout_s=args.write_timeout_s,
        max_connections=args.max_connections,
        api_key_file=args.api_key_file,
        served_model_name=args.served_model_name,
        **class_options(args),
        pool=args.pool,
        kv_label=next(iter(pool.kv_slots)) if pool is not None else KV_LABEL,
        speculative_tokens=pool.kv.speculative_tokens if pool is not None else 0,
    )
