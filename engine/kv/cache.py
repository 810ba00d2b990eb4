"""The KV manager: a request's page tables per label over one shared pool and prefix index.

Pages of a label are allocated as that label's tokens are written (`grow`); a label the request
does not write takes none (its rows go to the sink page). A capped label (a sliding window's or
an attention chunk's group, `LabelTerms.cap_tokens`) takes at most its cap of pages and then
reuses them as a ring, position p in page (p // page_size) mod cap: the window never reads
further back than the cap holds, which is how count_pages bounds it. Only the virtual runner
runs such a layout (kvbank's engine serves one full-attention label), and the prefix index
keys none of those pages (they are overwritten). Supply is what the pool can still hand
out, free plus evictable, as running totals: nothing here walks the pool on the step path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvbank.capacity import pages_for
from kvbank.engine.kv.host import HostEntry, HostMove, HostTier
from kvbank.engine.kv.pages import OutOfPages, PagePool
from kvbank.engine.kv.prefix import Node, PrefixIndex
from kvbank.engine.request import Request
from kvbank.ledger import InvariantBreach

Chains = dict[str, list[int]]  # label -> cached pages from the root, all labels equally deep


class KVCache:
    def __init__(self, total_pages: int, page_size: int, host_pages: int = 0) -> None:
        self.pool = PagePool(total_pages)
        # References by strict requests per page, and the pages with at least one: every other
        # held page is held by best-effort requests only.
        self.strict_refs = [0] * total_pages
        self.strict_held = 0
        self.host = HostTier(host_pages) if host_pages else None
        self.index = PrefixIndex(self.pool, page_size, digests=self.host is not None)
        if self.host is not None:
            self.index.spill = self._spill
        self.page_size = page_size

    @property
    def free(self) -> int:
        return self.pool.free

    @property
    def evictable(self) -> int:
        return self.index.evictable

    @property
    def supply(self) -> int:
        return self.pool.free + self.index.evictable

    # ---- prefix hits ---------------------------------------------------------------------------

    def peek(self, req: Request, after: Chains | None = None) -> Chains:
        """The request's cached prefix, per label, without re-stamping the LRU. Empty for a
        request with an unkeyed label (see `Request.cacheable`)."""
        if not req.cacheable:
            return {}
        limit = req.max_hit_pages
        tokens = req.keyed_tokens()
        chains = {
            lay.name: self.index.match(lay.name, tokens, limit, (after or {}).get(lay.name, ()))
            for lay in req.layout
        }
        depth = min((len(c) for c in chains.values()), default=0)
        return {name: chain[:depth] for name, chain in chains.items()} if depth else {}

    def idle_pages(self, chains: Chains) -> int:
        """Pages of a hit that only the index holds: leasing them takes them off the supply."""
        refcount = self.pool.refcount
        return sum(1 for chain in chains.values() for page in chain if refcount[page] == 0)

    def pin(self, req: Request, max_idle: int, sole_costs: bool = False) -> int:
        """Hold a waiting request's hit so that eviction cannot take it before its admission is
        applied. Pins only grow while the request waits, and take at most `max_idle` pages that
        only the index holds; with `sole_costs`, a page exactly one holder has costs as much
        (that holder no longer returns it when it finishes). Returns the pinned depth in pages,
        all labels."""
        chains = self.peek(req, req.pinned or None)
        if not chains:
            return self.pinned_pages(req)
        old_depth = len(next(iter(req.pinned.values()), ()))
        new_depth = len(next(iter(chains.values())))
        refcount = self.strict_refs  # holders that strict admission counts on
        most = 1 if sole_costs else 0
        depth = old_depth
        while depth < new_depth:
            cost = sum(1 for chain in chains.values() if refcount[chain[depth]] <= most)
            if cost > max_idle:
                break
            max_idle -= cost
            for name, chain in chains.items():
                self._hold(chain[depth], req)
                req.pinned.setdefault(name, []).append(chain[depth])
            depth += 1
        return self.pinned_pages(req)

    @staticmethod
    def pinned_pages(req: Request) -> int:
        return sum(len(chain) for chain in req.pinned.values())

    def unpin(self, req: Request, keep: int = 0) -> None:
        """Drop pins past the first `keep` pages per label. Not a use: no re-stamp."""
        for chain in req.pinned.values():
            for page in chain[keep:]:
                self._drop(page, req)
            del chain[keep:]
        if not keep:
            req.pinned.clear()

    def lease(self, req: Request, chains: Chains) -> int:
        """Give an admitted request its cached prefix: it skips those positions. Pages already
        pinned for it keep their reference (pins past the leased depth are dropped); the rest
        are held now. Returns pages leased."""
        self.unpin(req, keep=len(next(iter(chains.values()), ())))
        pinned = req.pinned
        leased = 0
        for name, chain in chains.items():
            table = req.pages.setdefault(name, [])
            have = len(pinned.get(name, ()))
            for position, page in enumerate(chain):
                if position >= have:
                    self._hold(page, req)
                table.append(page)
            leased += len(chain)
            self.index.touch(chain)
        req.pinned = {}
        depth = len(next(iter(chains.values()), ()))
        req.num_computed = depth * self.page_size
        req.indexed = depth
        req.held += leased
        req.hit_pages = leased
        return leased

    # ---- growth --------------------------------------------------------------------------------

    def need(self, req: Request, positions: int) -> int:
        """New pages the request must allocate to have room for `positions` positions."""
        prompt_len = len(req.prompt)
        size = self.page_size
        missing = 0
        for lay in req.layout:
            want = pages_for(lay.tokens_at(positions, prompt_len), size)
            have = len(req.pages.get(lay.name, ()))
            if want > have:
                missing += want - have
        return missing

    def grow(
        self,
        req: Request,
        positions: int,
        protected: Callable[[], Collection[int]] = frozenset,
        spare: bool = False,
    ) -> int:
        """Allocate room for `positions` positions, evicting idle cached pages if the free list
        runs out, the `protected` ones last (asked only when an eviction happens); with `spare`,
        never the protected ones (short instead, so a best-effort request can be preempted
        first). All or nothing: raises OutOfPages, changing nothing, when supply is short."""
        if positions <= req.room:
            return 0
        missing = self.need(req, positions)
        if not missing:
            req.room = self._room(req)
            return 0
        if missing > self.supply:
            raise OutOfPages(f"request {req.rid!r} needs {missing} pages, supply is {self.supply}")
        spared: Collection[int] | None = None
        if spare and missing > self.pool.free:
            spared = protected()
            kept = sum(1 for page in spared if not self.pool.refcount[page])
            if missing > self.supply - kept:
                raise OutOfPages(
                    f"request {req.rid!r} needs {missing} pages; supply is {self.supply}, "
                    f"{kept} of them cached for the waiting head"
                )
        prompt_len = len(req.prompt)
        for lay in req.layout:
            want = pages_for(lay.tokens_at(positions, prompt_len), self.page_size)
            table = req.pages.setdefault(lay.name, [])
            while len(table) < want:
                if not self.pool.free:
                    if spared is None:
                        spared = protected()
                    self.index.evict(spared)
                page = self.pool.allocate()
                if not req.best_effort:
                    self.strict_refs[page] += 1
                    self.strict_held += 1
                table.append(page)
        req.held += missing
        req.room = self._room(req)
        return missing

    # ---- the host tier -------------------------------------------------------------------------

    def grow_reloading(
        self,
        req: Request,
        positions: int,
        protected: Callable[[], Collection[int]] = frozenset,
    ) -> int:
        """`grow`, for a request just admitted with its device hit leased: the prompt pages that
        follow the hit on the host tier are copied into the pages allocated for them instead
        of being computed (indexed, and skipped like a hit). Admission counted them as pages
        to allocate, which they are; only the prefill work goes. Returns pages allocated."""
        reload = self.host_hit(req)
        if not reload or self.host is None:
            return self.grow(req, positions, protected)
        entries = [entry for depth in reload for entry in depth.values()]
        self.host.pin(entries)  # evictions below copy pages to host: they must not take these
        try:
            grown = self.grow(req, positions, protected)
        finally:
            self.host.unpin(entries)
        start = req.indexed
        for offset, depth in enumerate(reload):
            position = start + offset
            for name, entry in depth.items():
                table = req.pages[name]
                self.host.load(entry, table[position])
                parent = table[position - 1] if position else None
                if not self.index.insert(name, parent, entry.key, table[position]):
                    raise InvariantBreach(
                        f"request {req.rid!r}: reloaded page {table[position]} is already indexed"
                    )
        req.indexed = start + len(reload)
        req.num_computed = req.indexed * self.page_size
        return grown

    def host_hit(self, req: Request) -> list[dict[str, HostEntry]]:
        """Host entries, per prompt page and label, continuing the request's leased chain
        where the device index ends; a peek. Empty unless every label's device chain ends at
        the same depth (a deeper label would already have that page indexed)."""
        host = self.host
        if host is None or not len(host) or not req.cacheable:
            return []
        depth = req.indexed
        limit = req.max_hit_pages
        tokens = req.keyed_tokens()
        parents = {}
        for lay in req.layout:
            table = req.pages.get(lay.name, [])[:depth]
            if len(self.index.match(lay.name, tokens, depth + 1, table)) > depth:
                return []
            parents[lay.name] = self.index.node(table[-1]).digest if table else None
        found: list[dict[str, HostEntry]] = []
        while depth + len(found) < limit:
            key = self.index.page_key(tokens, depth + len(found))
            entries = {name: host.lookup(parent, name, key) for name, parent in parents.items()}
            hits = {name: entry for name, entry in entries.items() if entry is not None}
            if len(hits) < len(entries):
                break
            found.append(hits)
            parents = {name: entry.digest for name, entry in hits.items()}
        return found

    def take_moves(self) -> list[HostMove]:
        """The host copies of this step, in order, for the runner."""
        return self.host.take_moves() if self.host is not None and self.host.moves else []

    def _spill(self, node: Node) -> None:
        if self.host is not None and node.digest is not None:
            parent = node.parent.digest if node.parent is not None else None
            self.host.save(node.digest, parent, node.label, node.key, node.page)

    def _room(self, req: Request) -> int:
        """Positions the request's pages cover: the most `positions` with nothing to allocate."""
        prompt_len = len(req.prompt)
        room = 1 << 62
        for lay in req.layout:
            capacity = len(req.pages.get(lay.name, ())) * self.page_size
            if capacity < lay.tokens_at(prompt_len, prompt_len):
                return 0  # mid-prompt: no fast path, `need` decides
            if lay.cap_tokens is not None and capacity >= lay.cap_tokens:
                continue  # at its cap: it never takes another page
            if lay.per_output:
                prompt_part = lay.tokens_at(prompt_len, prompt_len)
                room = min(room, prompt_len + (capacity - prompt_part) // lay.per_output)
        return room

    def index_prompt(self, req: Request) -> None:
        """Offer the request's newly computed full prompt pages to the prefix index. Each is
        chained under the request's own previous page, which it holds, so nothing is ever
        chained under a page only the index holds."""
        if not req.index_open or not req.cacheable:
            return
        full = min(req.num_computed, len(req.prompt)) // self.page_size
        while req.indexed < full:
            position = req.indexed
            key = self.index.page_key(req.prompt, position)
            for lay in req.layout:
                table = req.pages[lay.name]
                parent = table[position - 1] if position else None
                if not self.index.insert(lay.name, parent, key, table[position]):
                    req.index_open = False
                    return
            req.indexed += 1

    def release(self, req: Request) -> None:
        """Drop every page of the request. Indexed pages become cached, re-stamped as just
        used; the rest go back to the free list."""
        for table in req.pages.values():
            self.index.touch(table)
            for page in table:
                self._drop(page, req)
        req.pages = {}
        req.held = 0
        req.room = 0
        req.indexed = 0
        req.index_open = True
        self.unpin(req)

    def share(self, req: Request, holder: Request, depth: int) -> None:
        """Give `req` the first `depth` pages per label of `holder`'s tables without holding
        them: a sequence of a group reads its group's prompt pages, which the group's first
        sequence holds once for all of them (so a page's holders are requests, never
        sequences), and computes from there. `req` writes no page it shares."""
        req.pages = {name: table[:depth] for name, table in holder.pages.items()}
        req.held = 0
        req.room = 0
        req.num_computed = depth * self.page_size
        req.indexed = depth
        req.index_open = False  # its pages past the shared ones are its own copy

    def drop_tail(self, req: Request, keep: int) -> int:
        """Drop the request's pages past the first `keep` per label (a sequence of a group that
        finished: its own pages go, the shared prompt pages stay). Returns pages dropped."""
        dropped = 0
        for table in req.pages.values():
            tail = table[keep:]
            self.index.touch(tail)
            for page in tail:
                self._drop(page, req)
            del table[keep:]
            dropped += len(tail)
        req.held -= dropped
        req.room = 0
        req.indexed = min(req.indexed, keep)
        req.index_open = False
        return dropped

    def _hold(self, page: int, req: Request) -> None:
        self.pool.hold(page)
        if not req.best_effort:
            refs = self.strict_refs[page]
            self.strict_refs[page] = refs + 1
            self.strict_held += not refs

    def _drop(self, page: int, req: Request) -> None:
        if not req.best_effort:
            refs = self.strict_refs[page] - 1
            self.strict_refs[page] = refs
            self.strict_held -= not refs
        indexed = page in self.index
        if self.pool.drop(page, indexed) and indexed:
            self.index.on_idle(page)

    @property
    def reclaimable(self) -> int:
        """Pages held by best-effort requests only: preempting them hands these back at once
        (as cache, or free), so strict admission counts them as supply."""
        return self.pool.held - self.strict_held

    # ---- integrity -----------------------------------------------------------------------------

    def check_integrity(self, deep: bool = False) -> None:
        self.pool.check_integrity(deep)
        if deep:
            self.index.check_integrity()
            if self.host is not None:
                self.host.check_integrity()
            refs, counts = self.strict_refs, self.pool.refcount
            strict = sum(1 for r in refs if r)
            if strict != self.strict_held or any(r > c for r, c in zip(refs, counts, strict=True)):
                raise InvariantBreach(
                    f"{strict} pages have a strict holder but the cache counts {self.strict_held}, "
                    f"or a page has more strict holders than holders"
                )

    def check_request(self, req: Request, deep: bool = False) -> None:
        """No request holds more pages than its worst case; (deep) its count matches its
        tables."""
        if req.held > req.worst:
            raise InvariantBreach(
                f"request {req.rid!r} holds {req.held} pages but may need at most {req.count.total}"
            )
        if not deep:
            return
        tables = sum(len(table) for table in req.pages.values())
        if tables != req.held:
            raise InvariantBreach(
                f"request {req.rid!r} counts {req.held} pages but its tables hold {tables}"
            )
