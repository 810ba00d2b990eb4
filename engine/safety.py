"""The second safety check: whether every running strict request can still get every page it
may need, recomputed after a step from the cache's raw state alone.

The ledger keeps its own books and checks its own invariant (kvbank/ledger/). A mistake in those
books, or in the arithmetic they share with the check, passes that check unseen. This one shares
no code with the ledger, its timeline or its books, and none of the cache's running totals: it
walks the running requests' page tables and the waiting requests' pins to find every page's
holders, reads the pool's free list and the prefix index only to compare them with what it
found, and recomputes the supply and each request's bound from the request itself (its tokens,
output, prefill left and the capacity function's count).

- The supply is the pages a strict request can be handed on demand: free pages, pages only the
  index holds (eviction reaches every one of them), and pages only best-effort requests hold
  (preempting them hands those back at once).
- Conservative modes (`banker`, `banker+backfill`): the sum over running strict requests of
  what they reserved and do not hold yet fits that supply.
- Peak-fit modes (`peak`, `peak+backfill`): at every future step, what the running strict
  requests may then hold beyond what they hold now, less what the ones surely finished by then
  give back (their pages no other strict request holds), fits that supply. A request advances
  one token a step and allocates the speculative positions past it; a prefill is served at the
  guaranteed rate, oldest admission first (docs/admission.md, "The bound").

Cost: O(pool pages + running requests x candidate steps x labels), for tests and
`kvbank bench --check`, never the serving path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvbank.capacity import CapacityModel
from kvbank.engine.kv.cache import KVCache
from kvbank.engine.request import Request
from kvbank.ledger import InvariantBreach


@dataclass(frozen=True)
class RawSupply:
    """Pages a strict request can be handed on demand, by where they come from."""

    free: int
    evictable: int
    reclaimable: int

    @property
    def total(self) -> int:
        return self.free + self.evictable + self.reclaimable


@dataclass(frozen=True)
class Holder:
    """One holder as the promise sees it: a lone request, or a group's sequences together."""

    req: Request  # the request admission knows (a group's first sequence)
    pages: tuple[int, ...]  # every page it holds, all labels and sequences


class SafetyCheck:
    """Run `check(running, waiting)` between steps; raises InvariantBreach with the numbers."""

    def __init__(
        self,
        kv: KVCache,
        model: CapacityModel,
        peak: bool,
        max_batch_tokens: int,
        max_running: int,
    ) -> None:
        self.kv = kv
        self.model = model
        self.peak = peak
        # The prefill rate the scheduler guarantees: decode rows are capped below the token
        # budget, so prefill gets the rest of every step (engine/scheduler.py serves it oldest
        # admission first).
        running_cap = max(1, min(max_running, max_batch_tokens - 1))
        self.prefill_rate = max(1, max_batch_tokens - running_cap)

    def check(self, running: Mapping[str, Request], waiting: Iterable[Request]) -> None:
        # In admission order: prefill is served in it.
        holders = [_holder(req) for req in running.values() if req.group is None or _leads(req)]
        counts, strict = self._holders(holders, list(waiting))
        supply = self._supply(counts, strict)
        strict_holders = [h for h in holders if not h.req.best_effort]
        if self.peak:
            order = [h.req for h in holders]
            self._check_peak(strict_holders, order, strict, supply)
        else:
            self._check_conservative(strict_holders, supply)

    # ---- raw state -----------------------------------------------------------------------------

    def _holders(
        self, holders: list[Holder], waiting: list[Request]
    ) -> tuple[list[int], list[int]]:
        """Holders per page, and strict holders per page, from the tables and pins; checked
        against the pool's own reference counts."""
        total = self.kv.pool.total_pages
        counts, strict = [0] * total, [0] * total
        for holder in holders:
            for page in holder.pages:
                counts[page] += 1
                strict[page] += not holder.req.best_effort
        for req in waiting:
            for chain in req.pinned.values():
                for page in chain:
                    counts[page] += 1
                    strict[page] += not req.best_effort
        refcount = self.kv.pool.refcount
        wrong = [page for page in range(total) if counts[page] != refcount[page]]
        if wrong:
            page = wrong[0]
            raise InvariantBreach(
                f"second check: the requests' tables and pins hold page {page} "
                f"{counts[page]} times but the pool counts {refcount[page]} references "
                f"({len(wrong)} pages disagree)"
            )
        return counts, strict

    def _supply(self, counts: list[int], strict: list[int]) -> RawSupply:
        index, pool = self.kv.index, self.kv.pool
        free = evictable = reclaimable = 0
        for page in range(pool.total_pages - pool.usable_pages, pool.total_pages):
            if counts[page]:
                reclaimable += not strict[page]
            elif page in index:
                evictable += 1
            else:
                free += 1
        if free != pool.free:
            raise InvariantBreach(
                f"second check: {free} pages are neither held nor indexed but the pool's free "
                f"list has {pool.free}"
            )
        return RawSupply(free, evictable, reclaimable)

    # ---- the conservative reading --------------------------------------------------------------

    def _check_conservative(self, holders: list[Holder], supply: RawSupply) -> None:
        page = self.model.page_size
        need = 0
        for holder in holders:
            req = holder.req
            reserved = _reserved(req, page)
            if len(holder.pages) > reserved:
                raise InvariantBreach(
                    f"second check: request {req.rid!r} holds {len(holder.pages)} pages but "
                    f"reserved {reserved}"
                )
            need += reserved - len(holder.pages)
        if need > supply.total:
            raise InvariantBreach(
                f"second check: the running strict requests may still take {need} pages but "
                f"the pool can hand out {supply.total} ({_said(supply)})"
            )

    # ---- the peak-fit reading ------------------------------------------------------------------

    def _check_peak(
        self,
        holders: list[Holder],
        running: list[Request],
        strict: list[int],
        supply: RawSupply,
    ) -> None:
        ends = {h.req.rid: self._end(h.req, running) for h in holders}
        # Demand only rises between two finishes, so it peaks now or at the step before one.
        steps = sorted({0, *(end - 1 for end in ends.values() if end > 0)})
        returned = {h.req.rid: sum(1 for page in h.pages if strict[page] == 1) for h in holders}
        for k in steps:
            demand = 0
            for holder in holders:
                req = holder.req
                if ends[req.rid] <= k:
                    demand -= returned[req.rid]
                else:
                    demand += max(0, self._pages_at(req, k) - len(holder.pages))
            if demand > supply.total:
                raise InvariantBreach(
                    f"second check: the running strict requests may need {demand} more pages "
                    f"at step {k} from now but the pool can hand out {supply.total} "
                    f"({_said(supply)})"
                )

    def _end(self, req: Request, running: list[Request]) -> int:
        """The first step from now at which `req` has surely finished: its prefill at the
        guaranteed rate behind every prefill admitted before it, then one token a step."""
        sequences = [req] if req.group is None else req.group.live()
        remaining = req.max_output - min(len(seq.output) for seq in sequences)
        if not _prefilling(req):
            return remaining
        ahead = 0
        for other in running:
            if _prefilling(other):
                ahead += _prefill_left(other)
            if other is req:
                break
        later = 0 if req.group is None else 1  # its other sequences start a step late
        return -(-ahead // self.prefill_rate) + later + remaining

    def _pages_at(self, req: Request, k: int) -> int:
        """Pages `req` may hold at step k from now (all its sequences)."""
        page, spec = self.model.page_size, self.model.speculative_tokens
        prefilling = _prefilling(req)
        if req.group is None:
            return _seq_pages(req, k, page, spec, prefilling, shared=0)
        group = req.group
        common = group.shared * len(req.layout)
        own = sum(_seq_pages(seq, k, page, spec, prefilling, group.shared) for seq in group.live())
        return common + own


def _seq_pages(seq: Request, k: int, page: int, spec: int, prefilling: bool, shared: int) -> int:
    """One sequence's pages at step k, past the `shared` pages per label its group holds once.
    Decoding: a step writes the token after the last written one and allocates `spec`
    positions past it. Prefilling: its prompt's pages are held; it may decode from the next
    step on."""
    prompt_len = len(seq.prompt)
    pages = 0
    for lay in seq.layout:
        worst = seq.count.tokens_per_label[lay.name]
        if prefilling:
            tokens = lay.tokens_at(seq.num_tokens, prompt_len)
            if k >= 1:
                tokens += lay.per_output * (k + spec)
        else:
            tokens = lay.tokens_at(seq.num_computed, prompt_len)
            tokens += lay.per_output * (k + 1 + spec)
        pages += -(-min(tokens, worst) // page) - shared
    return pages


def _holder(req: Request) -> Holder:
    if req.group is None:
        return Holder(req, tuple(page for table in req.pages.values() for page in table))
    group = req.group
    pages = [page for table in req.pages.values() for page in table]
    for seq in group.siblings:
        # A sequence reads its group's first `shared` pages per label without holding them.
        own = [page for table in seq.pages.values() for page in table[group.shared :]]
        if len(own) != seq.held:
            raise InvariantBreach(
                f"second check: sequence {seq.rid!r} counts {seq.held} pages but holds "
                f"{len(own)} past its group's {group.shared} shared pages per label"
            )
        pages.extend(own)
    return Holder(req, tuple(pages))


def _leads(req: Request) -> bool:
    return req.group is not None and req.group.leader is req


def _reserved(req: Request, page: int) -> int:
    """What the request may hold at most: its count, less the share of finished sequences."""
    if req.group is None:
        return req.count.total
    group = req.group
    live = len(group.live())
    shared = group.shared
    return sum(
        shared + live * (-(-tokens // page) - shared)
        for tokens in req.count.tokens_per_label.values()
    )


def _prefilling(req: Request) -> bool:
    if req.group is None:
        return req.num_tokens - req.num_computed > 1
    return not req.group.decoding()


def _prefill_left(req: Request) -> int:
    """Positions left to compute before it decodes: a group's other sequences compute from the
    shared pages on, which its first sequence computes."""
    group = req.group
    if group is None:
        return req.num_tokens - req.num_computed
    prefix = group.shared * group.page_size
    left = max(0, prefix - req.num_computed) if req.rid in group.done else 0
    for seq in group.live():
        if seq.rid not in group.primed:
            start = seq.num_computed if seq is req else max(seq.num_computed, prefix)
            left += seq.num_tokens - start
    return left


def _said(supply: RawSupply) -> str:
    return (
        f"free {supply.free} + evictable {supply.evictable} + held only by best-effort "
        f"requests {supply.reclaimable}"
    )
