"""`kvbank serve --pool FILE`: the engine's pool, limits and admission read from the ModelPool
manifest `kvbank sidecar --pool FILE` reads, so the two cannot disagree on the pool's size.

The manifest is judged as the sidecar judges it (`parse_modelpool`, then `kvbank check`'s
holdability). A flag given beside `--pool` must say what the manifest says: one that differs is
refused, naming both, rather than silently winning over the spec the operator judged.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.modelpool import KvSlot
from kvbank.poolfile import PoolFile
from kvbank.poolfile import read_pool as read_pool_file

# The engine's decoder writes one KV position per prompt token and per output token.
DECODER_SLOT = KvSlot(prompt=1, output=1)


@dataclass(frozen=True)
class PoolFlag:
    flag: str  # as the user types it
    dest: str  # the argparse attribute
    field: str  # the manifest's field


# The flags a ModelPool settles, in the order they are checked.
POOL_FLAGS = (
    PoolFlag("--pages", "pages", "spec.kv.pages"),
    PoolFlag("--page-size", "page_size", "spec.kv.pageSize"),
    PoolFlag("--host-pages", "host_pages", "spec.kv.hostPages"),
    PoolFlag("--max-seq-len", "max_seq_len", "spec.limits.maxSeqLen"),
    PoolFlag("--max-tokens", "max_tokens", "spec.limits.maxTokens"),
    PoolFlag("--policy", "policy", "spec.admission.policy and backfill"),
    PoolFlag("--default-class", "default_class", "spec.admission.defaultClass"),
    PoolFlag("--max-preemptions", "max_preemptions", "spec.admission.bestEffort.maxPreemptions"),
    PoolFlag("--victim", "victim", "spec.admission.bestEffort.victim"),
    PoolFlag("--estimate", "estimate", "spec.admission.bestEffort.estimate"),
)


def read_pool(path: str) -> PoolFile:
    """The one ModelPool in `path`, holdable, with the one KV label this engine's decoder
    writes (a configured pool's layout: one group of full attention). Raises ValueError saying
    what to change."""
    served = read_pool_file(path, "the engine")
    where = path
    if served.pool.admission.order != "fifo":
        raise ValueError(
            f"--pool {where}: spec.admission.order is {served.pool.admission.order}, which "
            "kvbank's scheduler class inside vLLM carries out; this engine asks in arrival "
            "order; drop it, or serve the pool with vLLM (spec.engine.kind: vllm)"
        )
    configured = served.configured
    if configured is not None:
        groups = configured.pool.groups
        if len(groups) != 1 or groups[0].kind.value != "full":
            described = ", ".join(f"{g.label} ({g.layers} layers, {g.rule()})" for g in groups)
            raise ValueError(
                f"--pool {where}: spec.model.architecture.fromConfig lays this model out in "
                f"{len(groups)} KV group(s): {described[:300]}; this engine's decoder writes "
                "one group of full attention. Serve it with vLLM (spec.engine.kind: vllm)"
            )
    elif len(served.kv_slots) != 1 or next(iter(served.kv_slots.values())) != DECODER_SLOT:
        raise ValueError(
            f"--pool {where}: spec.kvSlots declares {_slots(served.kv_slots)}, but this "
            f"engine's decoder writes one KV label of {{prompt: 1, output: 1}}; declare exactly "
            "that"
        )
    return served


def pool_values(served: PoolFile) -> dict[str, Any]:
    """The argparse values the pool settles, by dest."""
    pool = served.pool
    adm = pool.admission
    return {
        "pages": served.pages,
        "page_size": pool.kv.page_size,
        "host_pages": pool.kv.host_pages,
        "max_seq_len": pool.limits.max_seq_len,
        "max_tokens": pool.limits.max_tokens,
        "policy": adm.ledger_policy,
        "default_class": adm.default_class.value,
        "max_preemptions": adm.max_preemptions,
        "victim": adm.victim.value,
        "estimate": adm.estimate.value,
    }


def apply_pool(args: argparse.Namespace, defaults: Mapping[str, Any]) -> PoolFile:
    """Read `args.pool` into `args`. `defaults`: each pool flag's value when not given (a flag
    still at its default was not given). Raises ValueError for a flag that differs from the
    manifest, naming both."""
    served = read_pool(args.pool)
    values = pool_values(served)
    for flag in POOL_FLAGS:
        given = getattr(args, flag.dest)
        if given != defaults.get(flag.dest) and given != values[flag.dest]:
            raise ValueError(
                f"{flag.flag} {str(given)[:40]} conflicts with --pool {args.pool}, whose "
                f"{flag.field} gives {values[flag.dest]}; drop {flag.flag} (the pool settles "
                f"it), or change the manifest"
            )
    for dest, value in values.items():
        setattr(args, dest, value)
    return served


def _slots(slots: Mapping[str, KvSlot]) -> str:
    shown = ", ".join(
        f"{label[:40]}: {{prompt: {s.prompt}, output: {s.output}, fixed: {s.fixed}}}"
        for label, s in list(slots.items())[:4]
    )
    return f"{len(slots)} label(s) ({shown})"
