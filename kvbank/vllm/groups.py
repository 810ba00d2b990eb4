"""vLLM's KV cache groups, read for kvbank: their specs (`read_groups`, counted by
kvbank.vllm.layout) and, per request, the blocks each group holds (`Tables`), and the pages the
ledger counts as each request's (`Holding`).

A sliding window frees the blocks that fall out of it as the request runs, and a Mamba state in
"align" mode frees the state two steps back, so what a request holds in such a group goes down
as well as up. The ledger's books only grow while a request runs (a request takes pages and
releases them all at its end), so the pages it counts as a request's are, per group, the most
that request has held there; what it has freed since is still counted as its own, and is kept
out of the supply the ledger hears (`Holding.freed`), since the request may take it again. The
ledger's test `outstanding <= supply` then reads `sum(reserved - held now) <= free`, the exact
one; the same holds for the peak-fit timeline, whose curves never fall either.

A cached block two requests share is credited once (a hit costs no page) only where neither can
drop it before it ends: full attention and MLA (`steady` groups). A window may drop a shared
block while the other request keeps it, which frees no page yet leaves the dropper needing a new
one; so in a window or state group every request's copy of a shared block counts as its own
page, and the supply the ledger hears is lowered by the copies beyond the first
(`window_overlap`). Dropping one then lowers the request's holding and that overlap together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvbank.capacity import CapacityModel, PageCount, RequestShape, label_terms
from kvbank.ledger import InvariantBreach
from kvbank.vllm.layout import GroupSpec, Limits


def read_groups(kv_cache_config: Any) -> list[GroupSpec]:
    """vLLM's KV cache groups as kvbank.vllm.layout counts them."""
    return [
        _spec(group.kv_cache_spec, len(group.layer_names))
        for group in kv_cache_config.kv_cache_groups
    ]


def _spec(spec: Any, layers: int) -> GroupSpec:
    inner: tuple[GroupSpec, ...] = ()
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        inner = tuple(_spec(one, 1) for one in spec.kv_cache_specs.values())
    return GroupSpec(
        type(spec).__name__,
        layers,
        getattr(spec, "sliding_window", None),
        getattr(spec, "attention_chunk_size", None),
        block_size=int(getattr(spec, "block_size", 0) or 0),
        page_bytes=int(getattr(spec, "page_size_bytes", 0) or 0),
        extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
        mamba_cache_mode=str(getattr(spec, "mamba_cache_mode", "none")),
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        checkpoint_blocks=int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0),
        tokens_per_state=getattr(spec, "tokens_per_state", 1) if spec_is_attention(spec) else 1,
        inner=inner,
    )


def spec_is_attention(spec: Any) -> bool:
    return hasattr(spec, "num_kv_heads")


def limits_of(vllm_config: Any, block_size: int, max_model_len: int, lookahead: int) -> Limits:
    """The engine's limits that decide a window's worst case: the step's token budget and the
    batches in flight (VllmConfig.max_concurrent_batches where this vLLM has it)."""
    scheduler = vllm_config.scheduler_config
    batches = getattr(vllm_config, "max_concurrent_batches", None)
    if not isinstance(batches, int):
        batches = 2 if scheduler.async_scheduling else 1
    return Limits(
        block_size, max_model_len, lookahead, int(scheduler.max_num_batched_tokens), batches
    )


def steady_groups(model: CapacityModel) -> list[bool]:
    """Per group (label), whether its blocks stay until the request ends: every label but a
    window's (capped) and a state's (fixed tokens only)."""
    return [
        label not in model.label_caps and slot.prompt > 0 for label, slot in model.kv_slots.items()
    ]


def window_overlap(held: Iterable[list[int]]) -> int:
    """Copies beyond the first of each window or state block, over every holder's ids."""
    counts = Counter(block_id for ids in held for block_id in ids)
    return sum(n - 1 for n in counts.values())


def hit_credit(
    hit: list[list[Any]], steady: list[bool], holders: Callable[[Any], int] | None = None
) -> tuple[int, int]:
    """(blocks a hit gets without taking a page, of which held by one request alone): blocks
    another request holds in a steady group. The others (idle ones, and any block of a window
    or state group) the request takes as new pages. `holders(block)`: the holders that keep a
    block out of the supply (kvbank.vllm.classes.Classes.strict_holders: best-effort ones do
    not); vLLM's reference count when None."""
    count = holders or _ref_cnt
    shared = [b for group, keep in zip(hit, steady, strict=True) if keep for b in group]
    counts = [count(b) for b in shared]
    return sum(1 for n in counts if n > 0), sum(1 for n in counts if n == 1)


def _ref_cnt(block: Any) -> int:
    return int(block.ref_cnt)


def live(blocks: Any) -> list[Any]:
    """The blocks of one group's table that hold something: not vLLM's null block, which
    stands where a window or a state freed one."""
    return [block for block in blocks if not block.is_null]


def flat(groups: list[list[Any]]) -> list[Any]:
    """Blocks held group by group (a hit, a pin), as one list in group order."""
    return [block for group in groups for block in group]


# A block's holders that keep it out of the ledger's supply (kvbank.vllm.classes
# `strict_holders`): every count of sharing goes through it, never through `ref_cnt` alone.
Holders = Callable[[Any], int]


class Tables:
    """What vLLM's KV cache manager holds for a request, group by group."""

    def __init__(self, kv_cache_manager: Any) -> None:
        self.manager = kv_cache_manager

    def held(self, rid: str) -> list[list[Any]]:
        # The coordinator's lists, which `get_blocks` wraps in a new KVCacheBlocks each call.
        return [live(group) for group in self.manager.coordinator.get_blocks(rid)]

    def hit(self, request: Any) -> list[list[Any]]:
        """The cached blocks vLLM would give this waiting request now, per group."""
        blocks = self.manager.get_computed_blocks(request)[0].blocks
        return [live(group) for group in blocks]


@dataclass
class Holding:
    """An admitted request's pages, per group: its worst case (count_pages's `count`), the most
    it has held (what the ledger counts as held), and what it holds now."""

    labels: list[str]
    count: PageCount
    counted: list[int]
    now: list[int]
    steady: list[bool]
    shared: int = 0  # of its steady blocks now, those another strict request (or a pin) holds too
    window_ids: list[int] = field(default_factory=list)  # its window and state blocks now
    _terms: Any = field(default=None, repr=False)
    _read_tables: Any = field(default=None, repr=False)  # what `hold` last read: see there

    @classmethod
    def of(
        cls,
        model: CapacityModel,
        request: Any,
        count: PageCount,
        pinned: list[list[Any]],
        holders: Holders,
    ) -> Holding:
        """A request admitted holding `pinned` (its hit, per group)."""
        shape = RequestShape(request.num_prompt_tokens, request.max_tokens)
        held = [len(group) for group in pinned]
        holding = cls(list(model.kv_slots), count, list(held), list(held), steady_groups(model))
        holding._terms = label_terms(model, shape)
        holding._read(request.request_id, pinned, holders)
        return holding

    def hold(self, rid: str, tables: list[list[Any]], holders: Holders) -> int:
        """What vLLM holds for it now (`tables`, per group); returns the pages the ledger must
        hear as taken. Raises InvariantBreach, naming the group, where vLLM holds more than
        kvbank counted. `holders`: see `_read`.

        Steady groups only append while a request runs, so with no window or state group a
        table whose length and last block are as `hold` last read them is unchanged, and is
        not read again (a step grows a table once a block of tokens). Its `shared` may then lag
        its blocks' sharers; sharing gained comes from a newcomer, whose own table changed (and
        is read: `Admission.scheduled` sees its `shared` grow), or from an admission with a hit
        or a pin, and every figure the ledger hears of sharing is `recount`ed fresh."""
        tables_now = [(len(group), group[-1].block_id if group else -1) for group in tables]
        if tables_now != self._read_tables or not all(self.steady):
            self._read(rid, tables, holders)
            self._read_tables = tables_now
        grown = 0
        for i, held in enumerate(self.now):
            if held > self.counted[i]:
                grown += held - self.counted[i]
                self.counted[i] = held
        return grown

    def recount(self, rid: str, tables: list[list[Any]], holders: Holders) -> None:
        """What it holds now, between allocations (its blocks' sharing may have changed);
        raises InvariantBreach if it grew unreported."""
        self._read(rid, tables, holders)
        for label, held, counted in zip(self.labels, self.now, self.counted, strict=True):
            if held > counted:
                raise InvariantBreach(
                    f"vLLM holds {held} blocks of group {label} for {rid!r}, more than the "
                    f"{counted} the ledger heard of"
                )

    def _read(self, rid: str, tables: list[list[Any]], holders: Holders) -> None:
        """`holders(block)`: the holders that keep a block out of the supply the ledger hears
        (kvbank.vllm.classes `strict_holders`): a block this request shares only with
        best-effort requests comes back when it finishes, as reclaimable, so it is its own."""
        now = [len(group) for group in tables]
        for label, held, worst in zip(self.labels, now, self.worst, strict=True):
            if held > worst:
                raise InvariantBreach(
                    f"vLLM holds {held} blocks of group {label} for {rid!r} but kvbank's "
                    f"capacity function counted at most {worst}: a kvbank bug"
                )
        self.now = now
        steady = [group for group, keep in zip(tables, self.steady, strict=True) if keep]
        self.shared = sum(1 for group in steady for block in group if holders(block) > 1)
        self.window_ids = [
            block.block_id
            for group, keep in zip(tables, self.steady, strict=True)
            if not keep
            for block in group
        ]

    @property
    def worst(self) -> list[int]:
        return [self.count.per_label[label] for label in self.labels]

    @property
    def freed(self) -> int:
        """Pages the ledger counts as held that vLLM has freed (out of a window)."""
        return sum(self.counted) - sum(self.now)

    @property
    def exclusive(self) -> int:
        """Pages that come back when it finishes: what it holds alone, what it freed, and its
        window copies (the supply regains each, as a page or as overlap)."""
        return sum(self.counted) - self.shared

    def written(self, positions: int, prompt_tokens: int) -> dict[str, int]:
        """Tokens per label once `positions` positions are computed, as its count reads them
        (a window's label stops at its cap, a state's is its fixed size)."""
        return {
            label: min(
                terms.tokens_at(positions, prompt_tokens), self.count.tokens_per_label[label]
            )
            for label, terms in self._terms.items()
        }
