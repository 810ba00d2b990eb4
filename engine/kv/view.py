"""What admission may read of the KV cache (`CacheView`): a waiting request's cached hit and how
much of it only the index holds or exactly one request holds, a running request's exclusive
pages, what a pin cost, and the supply. Read-only: admission changes the cache only through the
decisions the scheduler carries out (engine/admission/actions.py), and never reads a page's
reference count itself.

The supply is free plus evictable pages. Pages a request class that may be preempted holds
would join it here as reclaimable supply (what preempting them gives back)."""

from __future__ import annotations

from collections.abc import Iterable

from kvbank.engine.kv.cache import Chains, KVCache
from kvbank.engine.request import Request


class CacheView:
    def __init__(self, kv: KVCache) -> None:
        self._kv = kv
        self._refcount = kv.pool.refcount  # the list itself: it is mutated, never replaced
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
        refcount = self._refcount
        counts = [refcount[page] for page in pinned]
        return sum(1 for count in counts if count <= 2), any(count == 2 for count in counts)

    def exclusive_pages(self, req: Request) -> int:
        """Pages only this running request holds. Only pages in the prefix index can be shared
        (a leased hit, or a prompt page another request leased since), so only those are looked
        at: O(indexed pages). A group of sequences is one holder: its other sequences' own
        pages (never indexed, engine/sequences.py) are its too."""
        refcount = self._refcount
        shared = sum(
            1 for table in req.pages.values() for page in table[: req.indexed] if refcount[page] > 1
        )
        others = 0 if req.group is None else sum(seq.held for seq in req.group.siblings)
        return req.held - shared + others
