"""A model's layer groups as a vLLM engine pools them on one rank: which KV cache groups it
makes, how many bytes one page (one block id) takes, and how many pages each group may hold for
one request. Each group becomes one label of `count_pages`, with the group's worst-case rule:

- full attention and MLA: every position;
- sliding window: at most ceil((window - 1 + inFlight) / pageSize) + 1 pages, `inFlight` being
  the tokens scheduled but not yet processed: `batches_in_flight` steps (two under vLLM's async
  scheduling, its default; one without) of at most max_num_batched_tokens each (or one decode row
  and its speculative tokens if more) -- the window before the first of them, those tokens, and
  one page the window may start inside (vLLM's SlidingWindowSpec.max_admission_blocks_per_request,
  which both sizes its pool and caps each request's reservation);
- chunked local attention: the current chunk and the tokens in flight,
  ceil((chunk + inFlight) / pageSize) pages, one more when chunks do not start on a page. Only
  with `hybrid_chunked_local` (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1): by default
  vLLM turns its hybrid allocator off for a model with an attention chunk, and then allocates
  chunked and sliding layers as full attention, every layer in one group;
- Mamba and linear attention: a fixed state of 1 + speculativeTokens pages whatever the length.

Pages follow vLLM's hybrid allocator (`vllm/v1/core/kv_cache_planning.py`, read, not copied): one
block pool for every group; layers of one kind form groups of `layers_per_group` layers (the
fewest layers of any kind, or the most when within 1.5x), padding the last group of a kind; a
page is `layers_per_group` layers' worth of one block. A state layer's page is padded up to an
attention layer's, and where the state is larger than an attention page at the given page size
the page size is raised to the smallest multiple of max(16, the page size asked for) tokens
that holds it (vLLM's Platform._align_hybrid_block_size, without prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbank.capacity.count import CapacityModel
from kvbank.capacity.modellayout import WEIGHT_DTYPES, Kind, LayerGroup, ModelLayout
from kvbank.modelpool import KvSlot

# KV dtypes and their bytes per element. fp8 is vLLM's per-tensor-scaled fp8 (no extra bytes);
# fp8_per_token_head adds one float32 scale per token, head and K/V, as vLLM budgets it.
KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_per_token_head": 1}
PAGE_ALIGNMENT = 16  # tokens: attention kernels take block sizes in multiples of this
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's API server on an 80 GiB-class GPU


class LayoutError(ValueError):
    """A layout the engine cannot pool this way; `field` names what to change."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class EngineSettings:
    """What, besides the model, decides the pool: the requested page size (tokens per block),
    tensor parallelism, the KV dtype, the step's token budget and speculative tokens."""

    page_size: int = 16
    tensor_parallel: int = 1
    kv_dtype: str = "bfloat16"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    speculative_tokens: int = 0
    batches_in_flight: int = 2  # vLLM's async scheduling (its default); 1 without
    hybrid_chunked_local: bool = False  # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1

    @property
    def step_tokens(self) -> int:
        """The most tokens one step writes for one request."""
        return max(self.max_num_batched_tokens, 1 + self.speculative_tokens)

    @property
    def in_flight_tokens(self) -> int:
        """The most tokens of one request scheduled but not yet processed, which a window or
        a chunk keeps on top of itself (vLLM's max_in_flight_tokens)."""
        return self.batches_in_flight * self.step_tokens


@dataclass(frozen=True)
class PoolGroup:
    """One KV cache group: a label of count_pages."""

    label: str
    kind: Kind
    layers: int  # the model's layers in it; layers_per_group less this is padding
    window: int  # sliding window or chunk; 0 for the others
    cap_pages: int | None  # the most pages one request holds here at once; None: every position
    state_pages: int  # pages a state group holds per request; 0 for attention

    def slot(self, page_size: int) -> KvSlot:
        if self.state_pages:
            return KvSlot(fixed=self.state_pages * page_size)
        return KvSlot(prompt=1, output=1)

    def rule(self) -> str:
        if self.state_pages:
            return f"{self.state_pages} page(s) of state per request"
        if self.cap_pages is not None:
            what = "window" if self.kind is Kind.SLIDING else "chunk"
            return f"{what} {self.window}: at most {self.cap_pages} pages"
        return "every position"


@dataclass(frozen=True)
class PoolLayout:
    """The pool one rank allocates for a model: its groups, the tokens per page (the requested
    size, or larger where a state must fit one page), bytes per page, and each group's share."""

    model_type: str
    groups: tuple[PoolGroup, ...]
    page_size: int
    page_bytes: int  # one block id across every layer it spans
    layers_per_group: int
    layer_page_bytes: int  # one layer's share of a page
    kv_heads_per_rank: int
    settings: EngineSettings

    @property
    def kv_slots(self) -> dict[str, KvSlot]:
        return {g.label: g.slot(self.page_size) for g in self.groups}

    @property
    def label_caps(self) -> dict[str, int]:
        return {g.label: g.cap_pages for g in self.groups if g.cap_pages is not None}

    def capacity_model(self, max_seq_len: int, max_tokens: int) -> CapacityModel:
        return CapacityModel(
            self.kv_slots,
            self.page_size,
            max_seq_len,
            max_tokens,
            self.settings.speculative_tokens,
            label_caps=self.label_caps,
        )


def heads_per_rank(layout: ModelLayout, tp: int) -> int:
    """KV heads one rank keeps: split when TP divides them, copied when TP exceeds them. Raises
    LayoutError naming tensorParallel when neither divides the other, or the query heads."""
    heads = layout.kv_heads
    if layout.attention_heads % tp:
        fits = [d for d in range(1, 65) if layout.attention_heads % d == 0]
        raise LayoutError(
            "tensorParallel",
            f"{tp} does not divide the model's {layout.attention_heads} attention heads; use "
            f"one of {', '.join(map(str, fits))}",
        )
    if heads % tp and tp % heads:
        raise LayoutError(
            "tensorParallel",
            f"{tp} cannot split the model's {heads} KV heads: one must divide the other",
        )
    for group in layout.groups:
        for name, size in group.state_divisors().items():
            if size % tp:
                raise LayoutError(
                    "tensorParallel", f"{tp} does not divide the model's {name} ({size})"
                )
    return max(1, heads // tp)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_bytes(group: LayerGroup, heads: int, kv_dtype: str) -> int:
    """Bytes one token takes in one attention layer of this group on one rank."""
    size = KV_DTYPE_BYTES[kv_dtype]
    if group.kind is Kind.MLA:  # one latent, replicated: not split by TP
        return group.head_dim_k * size
    scales = 2 * heads * 4 if kv_dtype == "fp8_per_token_head" else 0
    return heads * (group.head_dim_k + group.head_dim_v) * size + scales


def pool_layout(layout: ModelLayout, settings: EngineSettings) -> PoolLayout:
    """How vLLM pools this model on one rank with these settings."""
    if settings.kv_dtype not in KV_DTYPE_BYTES:
        raise LayoutError(
            "kvDtype", f"must be one of {', '.join(KV_DTYPE_BYTES)}, got {settings.kv_dtype!r}"
        )
    tp = settings.tensor_parallel
    heads = heads_per_rank(layout, tp)
    allocated = _allocated_groups(layout, settings)
    attention = [g for g in allocated if not g.kind.is_state]
    states = [g for g in allocated if g.kind.is_state]
    if not attention:
        raise LayoutError("model_type", f"{layout.model_type} has no attention layers to pool")
    token_bytes = {_token_bytes(g, heads, settings.kv_dtype) for g in attention}
    if len(token_bytes) > 1:
        raise LayoutError(
            "model_type",
            f"{layout.model_type}'s attention layers differ in bytes per token "
            f"({sorted(token_bytes)}); kvbank counts one page size for every group",
        )
    per_token = token_bytes.pop()
    page_size = settings.page_size
    state_bytes = 0
    if states:
        state_bytes = max(
            sum(g.state_elements(tp, settings.speculative_tokens))
            * WEIGHT_DTYPES[layout.weights_dtype]
            for g in states
        )
        # vLLM raises the block in steps of the page size asked for (at least a kernel block)
        step = max(PAGE_ALIGNMENT, page_size)
        fits = step * _cdiv(state_bytes, step * per_token)
        page_size = max(page_size, PAGE_ALIGNMENT * _cdiv(fits, PAGE_ALIGNMENT))
    layer_page = page_size * per_token

    counts = {id(g): g.layers for g in allocated}
    if len(allocated) == 1:
        per_group = allocated[0].layers
    else:
        fewest, most = min(counts.values()), max(counts.values())
        per_group = most if most < fewest * 1.5 else fewest
    groups: list[PoolGroup] = []
    for group in allocated:
        pieces = _cdiv(group.layers, per_group)
        for index in range(pieces):
            label = group.kind.value if pieces == 1 else f"{group.kind.value}.{index}"
            layers = len(range(index, group.layers, pieces))  # vLLM deals layers i::pieces
            groups.append(pool_group(group.kind, group.window, label, layers, page_size, settings))
    return PoolLayout(
        layout.model_type,
        tuple(groups),
        page_size,
        per_group * layer_page,
        per_group,
        layer_page,
        heads,
        settings,
    )


def _allocated_groups(layout: ModelLayout, settings: EngineSettings) -> tuple[LayerGroup, ...]:
    """The layer groups as vLLM allocates them. A model with an attention chunk runs without
    the hybrid allocator unless `hybrid_chunked_local`; then, where it has full attention
    layers, its chunked and sliding layers are allocated as full attention beside them (they
    still compute over their chunk or window), all in one group of every position."""
    kinds = {g.kind for g in layout.groups}
    if settings.hybrid_chunked_local or Kind.CHUNKED not in kinds or Kind.FULL not in kinds:
        return layout.groups
    local = (Kind.FULL, Kind.SLIDING, Kind.CHUNKED)
    merged = [g for g in layout.groups if g.kind in local]
    if len({(g.kv_heads, g.head_dim_k, g.head_dim_v) for g in merged}) > 1:
        return layout.groups  # vLLM cannot merge them either: pool_layout says why
    full = replace(merged[0], kind=Kind.FULL, layers=sum(g.layers for g in merged), window=0)
    allocated: list[LayerGroup] = []
    for group in layout.groups:  # the merged group where its first layers were
        if group.kind not in local:
            allocated.append(group)
        elif group is merged[0]:
            allocated.append(full)
    return tuple(allocated)


def pool_group(
    kind: Kind, window: int, label: str, layers: int, page_size: int, settings: EngineSettings
) -> PoolGroup:
    """One KV cache group's label and worst-case rule (the module docstring). `pool_layout` calls
    it for the groups it derives from a model; the vLLM plug-in (kvbank/vllm/layout.py) for the
    groups a running vLLM made, so both count alike."""
    step = settings.in_flight_tokens
    cap: int | None = None
    state = 0
    if kind is Kind.SLIDING:
        cap = _cdiv(window - 1 + step, page_size) + 1
    elif kind is Kind.CHUNKED:
        cap = _cdiv(window + step, page_size) + (1 if window % page_size else 0)
    elif kind.is_state:
        state = 1 + settings.speculative_tokens
    return PoolGroup(label, kind, layers, window, cap, state)
