"""What kvbank can count of a vLLM engine: one KV cache group of full attention, whose pages are
vLLM's blocks. The capacity model is built from vLLM's own block size and limits, so the ledger
reserves with `kvbank.capacity.count_pages` exactly what vLLM's KV cache manager may allocate
(one label: a token of prompt or output writes one slot)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.capacity import CapacityModel
from kvbank.modelpool import KvSlot

LABEL = "kv"  # the one label: vLLM's full-attention KV
FULL_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")


@dataclass(frozen=True)
class GroupSpec:
    """One of vLLM's KV cache groups, as far as kvbank needs to know it."""

    kind: str  # the spec's class name: FullAttentionSpec, SlidingWindowSpec, MambaSpec, ...
    layers: int
    sliding_window: int | None = None


class UnsupportedLayout(ValueError):
    """vLLM's KV layout is one kvbank cannot count yet; the message names what."""


def check_layout(groups: Sequence[GroupSpec]) -> None:
    if not groups:
        raise UnsupportedLayout("kvbank's scheduler needs a model with a KV cache; it has none")
    described = ", ".join(
        f"{g.kind} ({g.layers} layers"
        + (f", sliding window {g.sliding_window}" if g.sliding_window else "")
        + ")"
        for g in groups
    )
    if len(groups) > 1:
        raise UnsupportedLayout(
            f"this model has {len(groups)} KV cache groups ({described}); kvbank counts one "
            "group of full attention only, so sliding-window, chunked-local and hybrid "
            "(Mamba) models are not supported yet: serve it without "
            "--scheduler-cls kvbank.vllm.KvbankScheduler"
        )
    group = groups[0]
    if group.kind not in FULL_ATTENTION or group.sliding_window:
        raise UnsupportedLayout(
            f"this model's KV cache is {described}; kvbank counts full attention only "
            f"({' or '.join(FULL_ATTENTION)}), so serve it without "
            "--scheduler-cls kvbank.vllm.KvbankScheduler"
        )


def capacity_model(block_size: int, max_model_len: int, lookahead_tokens: int) -> CapacityModel:
    """vLLM's limits as kvbank's capacity function reads them: a page is a block, a request
    that sends no max_tokens may run to max_model_len, and each decode step allocates
    `lookahead_tokens` slots past the token it writes (speculative decoding)."""
    return CapacityModel(
        {LABEL: KvSlot(prompt=1, output=1)},
        page_size=block_size,
        max_seq_len=max_model_len,
        max_tokens=max(1, max_model_len - 1),
        speculative_tokens=lookahead_tokens,
    )
