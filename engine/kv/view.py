"""What admission may read of the KV cache (`CacheView`): a waiting request's cached hit and how
much of it only the index holds or exactly one request holds, a running request's exclusive
pages, what a pin cost, and the supply. Read-only: admission changes the cache only through the
decisions the scheduler carries out (engine/admission/actions.py), and never reads a page's
reference count itself.

The supply is free plus evictable pages. Strict admission counts one more part, the pages only
best-effort requests hold (`reclaimable`): preempting those requests hands them back at once, as
cache or free pages. So the supply the ledger is told (`ledger_supply`) is free plus evictable
plus reclaimable, and a strict request's hit is idle, or sole, by its strict holders only
(`strict_idle_pages`, `strict_sole_pages`): leasing a page only best-effort requests hold takes
it off the reclaimable part, as leasing an idle page takes it off the evictable part. With no
best-effort request these are exactly the plain figures."""

from __future__ import annotations

from collections.abc import Iterable

from kvbank.engine.kv.cache import Chains, KVCache
from kvbank.engine.kv.victims import caches_output
from kvbank.engine.request import Request


class CacheView:
    def __init__(self, kv: KVCache) -> None:
        self._kv = kv
        self._refcount = kv.pool.refcount  # the list itself: it is mutated, never replaced
        self._strict = kv.strict_refs  # strict holders per page, likewise
        self.page_size = kv.page_size
        self.total_pages = kv.pool.total_pages

    @property
    def free(self) -> int:
        return self._kv.free

    @property
    def evictable(self) -> int:
        return self._kv.evictable

    @property
    def supply(self) -> int:
        return self._kv.supply

    @property
    def host_pages(self) -> int:
        """The host tier's capacity in pages (0: none)."""
        host = self._kv.host
        return host.capacity if host is not None else 0

    def caches_output(self, req: Request) -> bool:
        """Whether a preempted request's computed pages stay cached (engine/kv/victims.py)."""
        return caches_output(req)

    @property
    def reclaimable(self) -> int:
        """Pages only best-effort requests hold: preempting them gives these back at once."""
        return self._kv.reclaimable

    def ledger_supply(self) -> tuple[int, int]:
        """(free, evictable) as strict admission counts them: the reclaimable pages join the
        evictable part (both come back on demand, one by eviction, one by preemption)."""
        kv = self._kv
        return kv.free, kv.evictable + kv.reclaimable

    def strict_idle_pages(self, chains: Chains) -> int:
        """Pages of a hit no strict request holds: leasing them takes them off the strict
        supply (idle ones off the evictable part, best-effort ones off the reclaimable)."""
        strict = self._strict
        return sum(1 for chain in chains.values() for page in chain if strict[page] == 0)

    def strict_sole_pages(self, chains: Chains) -> int:
        """Pages of a hit exactly one strict request holds (see `sole_pages`)."""
        strict = self._strict
        return sum(1 for chain in chains.values() for page in chain if strict[page] == 1)

    @property
    def index_version(self) -> int:
        """Bumped when a page enters or leaves the prefix index: a hit may differ since."""
        return self._kv.index.version

    def peek(self, req: Request) -> Chains:
        """The request's cached prefix per label, without re-stamping the LRU."""
        return self._kv.peek(req)

    def idle_pages(self, chains: Chains) -> int:
        """Pages of a hit only the index holds: leasing them takes them off the supply."""
        return self._kv.idle_pages(chains)

    def sole_pages(self, chains: Chains) -> int:
        """Pages of a hit exactly one request holds: that holder no longer returns them alone
        when it finishes once the hit is leased."""
        refcount = self._refcount
        return sum(1 for chain in chains.values() for page in chain if refcount[page] == 1)

    def pinned_pages(self, req: Request) -> int:
        """Pages pinned for a waiting request, all labels."""
        return self._kv.pinned_pages(req)

    def pin_cost(self, pinned: Iterable[int]) -> tuple[int, bool]:
        """Of pages just pinned: how many were idle or held by exactly one request before the
        pin (each costs a page of headroom), and whether any was held by one request (whose
        exclusive count then changed)."""
        refcount = self._strict  # pins are strict holders; what a best-effort one holds costs
        counts = [refcount[page] for page in pinned]
        return sum(1 for count in counts if count <= 2), any(count == 2 for count in counts)

    def exclusive_pages(self, req: Request) -> int:
        """Pages of this running strict request that no other strict request holds: what the
        ledger's supply gains when it finishes (each becomes free, evictable, or reclaimable if
        a best-effort request still holds it). Counting every holder instead made a best-effort
        lease of a strict request's prefix lower its count at the next recount, with the supply
        unchanged, and broke the peak-fit ledger's invariant (docs/admission.md). Only pages in
        the prefix index can be shared (a leased hit, or a prompt page another request leased
        since), so only those are looked at: O(indexed pages). A group of sequences is one
        holder: its other sequences' own pages (never indexed, engine/sequences.py) are its
        too."""
        refcount = self._strict  # strict holders per page: a pin is one, best-effort leases not
        shared = sum(
            1 for table in req.pages.values() for page in table[: req.indexed] if refcount[page] > 1
        )
        others = 0 if req.group is None else sum(seq.held for seq in req.group.siblings)
        return req.held - shared + others
