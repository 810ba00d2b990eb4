"""Everything one rank serves with: tokenizer, model, runner and engine, built from options.

`kvbank serve` and every tensor-parallel rank build their stack here, so the built-in model and a
real checkpoint go through the same loader, and every rank's pool has the same page count.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbank.capacity import CapacityModel
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.model.attention import default_attention
from kvbank.engine.model.builtin import builtin_model_dir
from kvbank.engine.model.config import ModelConfig
from kvbank.engine.model.llama import Parallel
from kvbank.engine.model.loader import DTYPES, load_model
from kvbank.engine.model.runner import TorchRunner
from kvbank.engine.model.tokenizer import Tokenizer
from kvbank.ledger.client import LedgerClient
from kvbank.modelpool import DEFAULT_POLICY, KvSlot
from kvbank.service_class import (
    DEFAULT_MAX_PREEMPTIONS,
    ClassPolicy,
    Estimate,
    ServiceClass,
    Victim,
)

BUILTIN_NAME = "kvbank-builtin"
KV_LABEL = "kv"  # a decoder writes one KV position per prompt and per output token


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None  # a Hugging Face folder; None: the built-in model
    pages: int = 1024  # per rank, the sink page included
    page_size: int = 16
    host_pages: int = 0  # per rank: a host tier for evicted prefix pages; 0: none
    max_seq_len: int | None = None  # None: min(max_position_embeddings, 4096)
    max_tokens: int = 256
    policy: str = DEFAULT_POLICY
    attention: str | None = None  # None: flashinfer on CUDA when installed, else torch
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    max_batch_tokens: int = 2048
    max_running: int = 256
    max_waiting: int = 256  # beyond this the HTTP API answers 429
    threads: int | None = 1  # torch intra-op threads on CPU; None: torch's default
    sidecar: str | None = None
    sidecar_token_file: str | None = None
    sidecar_ca_file: str | None = None  # with it, the sidecar is reached over TLS
    sidecar_tls_server_name: str | None = None
    debug: bool = False
    seed: int = 0
    # The HTTP front: bounds on what a client may send and how slowly, and who may call /v1.
    max_body_bytes: int = 2 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0  # a response its client stops reading is dropped after this
    max_connections: int | None = None  # None: the open-files limit less a reserve
    api_key_file: str | None = None
    served_model_name: str | None = None  # None: kvbank-builtin, or the model folder's name
    # The class settings (EngineConfig.classes), kept as plain values so the tensor-parallel
    # launcher hands them to every rank as JSON.
    default_class: str = ServiceClass.STRICT.value
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    victim: str = Victim.NEWEST.value
    estimate: str = Estimate.LEARNED.value
    extra: dict[str, Any] = field(default_factory=dict)
    # From `--pool FILE` (the ModelPool the sidecar reads too); else the defaults below.
    pool: str | None = None
    kv_label: str = KV_LABEL
    speculative_tokens: int = 0

    @property
    def classes(self) -> ClassPolicy:
        return ClassPolicy(
            ServiceClass(self.default_class),
            self.max_preemptions,
            Victim(self.victim),
            Estimate(self.estimate),
        )


@dataclass
class Stack:
    name: str
    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer
    capacity: CapacityModel
    runner: TorchRunner
    engine: Engine
    options: ServeOptions
    attention: str


def resolve_model_dir(options: ServeOptions) -> tuple[str, Path]:
    if options.model is None:
        return BUILTIN_NAME, builtin_model_dir()
    path = Path(options.model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"--model {options.model} is not a folder; give a Hugging Face model folder "
            f"(config.json, *.safetensors, tokenizer.json) or omit --model for the built-in one"
        )
    return path.resolve().name, path


def sidecar_backend(
    address: str,
    total_pages: int,
    token: str | None = None,
    tls_ca: bytes | None = None,
    tls_server_name: str | None = None,
) -> LedgerClient:
    """The gRPC backend of `kvbank.sidecar.backend`, non-blocking under every policy: the step
    loop never waits on the sidecar; its decisions are applied at a later step. The sidecar is
    asked once here, so a wrong token, certificate or address ends start-up with a message
    instead of the first request's 503."""
    try:
        module = importlib.import_module("kvbank.sidecar.backend")
        connect = module.connect
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"--sidecar {address}: this installation has no kvbank.sidecar.backend.connect to "
            f"reach a sidecar with ({exc}); run without --sidecar to admit with the embedded "
            f"ledger"
        ) from exc
    backend: LedgerClient = connect(
        address,
        total_pages,
        blocking=False,
        token=token,
        tls_ca=tls_ca,
        tls_server_name=tls_server_name,
        verify=True,
    )
    return backend


def options_sidecar_backend(options: ServeOptions) -> LedgerClient:
    """The sidecar backend `--sidecar` (with its token and CA files) asks for."""
    assert options.sidecar is not None
    token, ca = None, None
    try:
        if options.sidecar_token_file:
            token = Path(options.sidecar_token_file).read_text().strip() or None
            if token is None:
                raise ValueError(f"--sidecar-token-file {options.sidecar_token_file} is empty")
        if options.sidecar_ca_file:
            ca = Path(options.sidecar_ca_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror or exc}") from exc
    return sidecar_backend(
        options.sidecar, options.pages, token, ca, options.sidecar_tls_server_name
    )


def check_sidecar(options: ServeOptions) -> None:
    """Ask `--sidecar` once, as `options_sidecar_backend` does, and let it go: for a launcher
    whose rank 0 connects later. Raises ValueError saying what to fix."""
    backend = options_sidecar_backend(options)
    client = getattr(backend, "client", None)
    if client is not None:
        client.close()


def build_stack(
    options: ServeOptions,
    parallel: Parallel | None = None,
    backend: LedgerClient | None = None,
    model_dir: Path | None = None,
    device_index: int | None = None,
) -> Stack:
    """`device_index`: the GPU a tensor-parallel rank drives; None gives rank r cuda:r, as when
    every rank runs on one machine (a rank in its own pod sees one GPU: 0)."""
    if backend is None and options.sidecar:  # kvbank serve accepts only the sidecar's policies
        backend = options_sidecar_backend(options)  # first: a bad token fails before the load
    if model_dir is None:
        name, model_dir = resolve_model_dir(options)
    else:
        name = BUILTIN_NAME if options.model is None else model_dir.name
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and parallel is not None and parallel.world > 1:
        device = torch.device("cuda", parallel.rank if device_index is None else device_index)
        torch.cuda.set_device(device)
    if device.type == "cpu" and options.threads:
        torch.set_num_threads(options.threads)
    dtype = DTYPES[options.dtype] if options.dtype else None
    tokenizer = Tokenizer(model_dir)
    model = load_model(model_dir, device, dtype, parallel)
    config = model.config
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = config.eos_token_ids[0] if config.eos_token_ids else -1
    max_seq_len = options.max_seq_len or min(config.max_position_embeddings, 4096)
    if max_seq_len > config.max_position_embeddings:
        given = f"--max-seq-len {max_seq_len}"
        if options.pool:
            given = f"spec.limits.maxSeqLen {max_seq_len} of --pool {options.pool}"
        raise ValueError(
            f"{given} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}; lower it to at most "
            f"{config.max_position_embeddings}"
        )
    if not 1 <= options.max_tokens < max_seq_len:
        raise ValueError(
            f"--max-tokens {options.max_tokens} must be between 1 and --max-seq-len - 1 "
            f"({max_seq_len - 1})"
        )
    capacity = CapacityModel(
        {options.kv_label: KvSlot(prompt=1, output=1)},
        options.page_size,
        max_seq_len,
        options.max_tokens,
        options.speculative_tokens,
    )
    attention = options.attention or default_attention(device)
    runner = TorchRunner(
        model, options.pages, options.page_size, eos, attention, options.seed, options.host_pages
    )
    engine_config = EngineConfig(
        capacity,
        options.pages,
        policy=options.policy,
        max_batch_tokens=options.max_batch_tokens,
        max_running=options.max_running,
        host_pages=options.host_pages,
        classes=options.classes,
        debug=options.debug,
    )
    engine = Engine(engine_config, runner, backend)
    open_session = getattr(engine.backend, "open_session", None)
    if options.sidecar and open_session is not None:
        # Now that the policy configured the backend: a sidecar that will not serve this
        # engine (another pool or policy) ends start-up here, not with the first request.
        open_session()
    return Stack(name, model_dir, config, tokenizer, capacity, runner, engine, options, attention)
