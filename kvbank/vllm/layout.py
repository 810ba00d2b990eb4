"""What kvbank counts of a vLLM engine: its KV cache groups (kv_cache_config.kv_cache_groups),
each one label of the capacity function with that group's worst-case rule
(`kvbank.capacity.layout.pool_group`, the rule `kvbank check` and the webhook apply):

- FullAttentionSpec, MLAAttentionSpec: every position. A FullAttentionSpec that records a
  window or a chunk is a model run without the hybrid allocator: vLLM keeps every position;
- SlidingWindowSpec (and SlidingWindowMLASpec): the window, its extra retained tokens and the
  tokens in flight (vLLM frees the blocks that fall out of the window as the request runs);
- ChunkedLocalAttentionSpec: the current chunk and the tokens in flight;
- MambaSpec: a fixed state of 1 + its speculative blocks, under mamba_cache_mode "none" (a
  hybrid model served without prefix caching). Under "align" (prefix caching on), vLLM frees a
  state two steps late and copies shared states on write, which kvbank does not count yet: it
  is refused, naming --no-enable-prefix-caching;
- UniformTypeKVCacheSpecs: its layers' one rule, when they share one.

Every group allocates from vLLM's one block pool, so a page is a block of any group and a
request's worst case is the sum of its groups'. Any other spec (cross attention, R-SWA, a
circular buffer, sparse or compressed caches) is refused at start-up, naming it, as are
attention groups whose blocks hold different numbers of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.capacity import CapacityModel
from kvbank.capacity.layout import EngineSettings, PoolGroup, PoolLayout, pool_group
from kvbank.capacity.modellayout import Kind

ATTENTION = {
    "FullAttentionSpec": Kind.FULL,
    "MLAAttentionSpec": Kind.MLA,
    "SlidingWindowSpec": Kind.SLIDING,
    "SlidingWindowMLASpec": Kind.SLIDING,
    "ChunkedLocalAttentionSpec": Kind.CHUNKED,
}
STATE = {"MambaSpec": Kind.MAMBA2}  # every state kind has the one rule: a fixed state
UNIFORM = "UniformTypeKVCacheSpecs"
MAMBA_MODES = ("none",)
NOT_KVBANK = "serve it without --scheduler-cls kvbank.vllm.KvbankScheduler"


@dataclass(frozen=True)
class GroupSpec:
    """One of vLLM's KV cache groups, as far as kvbank needs to know it (kvbank.vllm.groups
    reads it off vLLM's spec)."""

    kind: str  # the spec's class name: FullAttentionSpec, SlidingWindowSpec, MambaSpec, ...
    layers: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    block_size: int = 0  # tokens per block
    page_bytes: int = 0
    extra_retained_tokens: int = 0  # kept below a sliding window (multi-token prediction)
    mamba_cache_mode: str = "none"
    speculative_blocks: int = 0  # a state's blocks for speculative tokens
    checkpoint_blocks: int = 0  # a state's prefill checkpoint blocks (under "align")
    tokens_per_state: object = 1  # an attention page's tokens per stored state
    inner: tuple[GroupSpec, ...] = ()  # UniformTypeKVCacheSpecs: its layers' specs

    def describe(self) -> str:
        extra = ""
        if self.sliding_window:
            extra = f", sliding window {self.sliding_window}"
        elif self.attention_chunk_size:
            extra = f", attention chunk {self.attention_chunk_size}"
        elif self.kind in STATE:
            extra = f", mamba_cache_mode {self.mamba_cache_mode}"
        return f"{self.kind} ({self.layers} layers{extra})"


class UnsupportedLayout(ValueError):
    """vLLM's KV layout is one kvbank cannot count yet; the message names what."""


@dataclass(frozen=True)
class Limits:
    """What besides the groups decides a request's worst case in vLLM: tokens per block, its
    limits, the tokens each decode step allocates past the one it writes (speculative
    decoding), the step's token budget and the steps in flight at once (2 under async
    scheduling, 1 without)."""

    block_size: int
    max_model_len: int
    lookahead_tokens: int = 0
    max_num_batched_tokens: int = 8192
    batches_in_flight: int = 1


def counted_kind(group: GroupSpec, lookahead_tokens: int = 0) -> tuple[Kind, int]:
    """The capacity function's kind for this group and its window or chunk (0 for the
    others); raises UnsupportedLayout naming the group when kvbank cannot count it."""
    where = group.describe()
    if group.kind == UNIFORM:
        rules = {counted_kind(inner, lookahead_tokens) for inner in group.inner}
        if len(rules) != 1:
            raise UnsupportedLayout(
                f"a KV cache group mixes layers of different rules ({where}: "
                f"{', '.join(sorted(i.describe() for i in group.inner))}); kvbank counts one "
                f"rule per group, so {NOT_KVBANK}"
            )
        return rules.pop()
    if group.kind in STATE:
        if group.mamba_cache_mode not in MAMBA_MODES:
            raise UnsupportedLayout(
                f"{where}: kvbank counts a Mamba state under mamba_cache_mode "
                f"{' or '.join(MAMBA_MODES)} only; start vllm serve with "
                f"--no-enable-prefix-caching, or {NOT_KVBANK}"
            )
        if group.speculative_blocks > lookahead_tokens:
            raise UnsupportedLayout(
                f"{where} keeps {group.speculative_blocks} speculative blocks but the "
                f"scheduler looks {lookahead_tokens} tokens ahead; {NOT_KVBANK}"
            )
        return STATE[group.kind], 0
    kind = ATTENTION.get(group.kind)
    if kind is None:
        counted = ", ".join([*ATTENTION, *STATE])
        raise UnsupportedLayout(
            f"this model's KV cache has {where}, which kvbank cannot count (it counts "
            f"{counted}); {NOT_KVBANK}"
        )
    if group.tokens_per_state != 1:
        raise UnsupportedLayout(
            f"{where} stores one state per {group.tokens_per_state} tokens; kvbank counts a "
            f"slot per token, so {NOT_KVBANK}"
        )
    if kind is Kind.SLIDING:
        return kind, (group.sliding_window or 0) + group.extra_retained_tokens
    if kind is Kind.CHUNKED:
        return kind, group.attention_chunk_size or 0
    return kind, 0  # a FullAttentionSpec with a window: vLLM keeps every position


def check_layout(groups: Sequence[GroupSpec], lookahead_tokens: int = 0) -> None:
    """Raise UnsupportedLayout, naming the group, unless kvbank can count every group."""
    if not groups:
        raise UnsupportedLayout("kvbank's scheduler needs a model with a KV cache; it has none")
    for group in groups:
        counted_kind(group, lookahead_tokens)
    attention = {g.block_size for g in groups if g.kind not in STATE and g.block_size}
    if len(attention) > 1:
        raise UnsupportedLayout(
            f"this model's attention groups hold different tokens per block "
            f"({', '.join(f'{g.describe()}: {g.block_size}' for g in groups)}); kvbank counts "
            f"one page size, so {NOT_KVBANK}"
        )


def page_size(groups: Sequence[GroupSpec], scheduler_block_size: int) -> int:
    """Tokens per page: an attention group's block (a state's block, max_model_len tokens
    without prefix caching, is one page whatever its tokens), else the scheduler's."""
    sizes = [g.block_size for g in groups if g.kind not in STATE and g.kind != UNIFORM]
    sizes += [i.block_size for g in groups for i in g.inner if i.kind not in STATE]
    return next((size for size in sizes if size), scheduler_block_size)


def labels(groups: Sequence[GroupSpec], lookahead_tokens: int = 0) -> list[str]:
    """One label per group, in vLLM's group order: g0-full, g1-sliding, ..."""
    return [f"g{i}-{counted_kind(g, lookahead_tokens)[0].value}" for i, g in enumerate(groups)]


def pool_layout(groups: Sequence[GroupSpec], limits: Limits) -> PoolLayout:
    """vLLM's pool as the capacity function reads it, one label per group (checked first)."""
    check_layout(groups, limits.lookahead_tokens)
    settings = EngineSettings(
        page_size=limits.block_size,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        speculative_tokens=limits.lookahead_tokens,
        batches_in_flight=limits.batches_in_flight,
    )
    pooled: list[PoolGroup] = []
    for group, label in zip(groups, labels(groups, limits.lookahead_tokens), strict=True):
        kind, window = counted_kind(group, limits.lookahead_tokens)
        pooled.append(pool_group(kind, window, label, group.layers, limits.block_size, settings))
    page_bytes = max((g.page_bytes for g in groups), default=0)
    per_group = max(g.layers for g in groups)
    return PoolLayout(
        "vllm", tuple(pooled), limits.block_size, page_bytes, per_group,
        page_bytes // per_group, 0, settings,
    )  # fmt: skip


def capacity_model(groups: Sequence[GroupSpec], limits: Limits) -> CapacityModel:
    """vLLM's limits as kvbank's capacity function reads them: a page is a block, a request
    that sends no max_tokens may run to max_model_len, each decode step allocates
    `lookahead_tokens` slots past the token it writes, and each group is a label."""
    return pool_layout(groups, limits).capacity_model(
        limits.max_model_len, max(1, limits.max_model_len - 1)
    )
