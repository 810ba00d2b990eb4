"""The prefix index: full pages of prompt tokens, keyed by the chain of page contents.

A node is one page of one KV label; its key is the page's tokens and its parent is the page
before it, so a node stands for the whole prefix up to and including its page. Two rules keep
eviction simple and its count exact:

- Every holder holds a chain from the root (a request leases its whole cached prefix and indexes
  only pages chained under pages it holds), and `insert` refuses a parent only the index holds.
  So no held page ever sits below an index-only page, every index-only page is reachable by
  leaf-only eviction, and the evictable count is simply the pool's cached count: no walk needed.
- Eviction takes leaves only, least recently used first (a heap with lazy deletion: O(log n) per
  eviction, no scan). A peek (`match`) never re-stamps; only a lease, an insert or a release does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvbank.engine.kv.host import Digest, chain_digest
from kvbank.engine.kv.pages import OutOfPages, PagePool
from kvbank.ledger import InvariantBreach

Key = tuple[int, ...]


@dataclass(eq=False)
class Node:
    page: int
    label: str
    key: Key
    parent: Node | None
    stamp: int
    children: dict[Key, Node] = field(default_factory=dict)
    digest: Digest | None = None  # the chain's identity on the host tier (kept only with one)


class PrefixIndex:
    def __init__(self, pool: PagePool, page_size: int, digests: bool = False) -> None:
        self.pool = pool
        self.page_size = page_size
        # With a host tier, every node keeps its chain's digest, and an evicted page is handed
        # to `spill` (which copies it to host) before its page returns to the free list.
        self.digests = digests
        self.spill: Callable[[Node], None] | None = None
        self._roots: dict[str, dict[Key, Node]] = {}
        self._nodes: dict[int, Node] = {}  # page id -> node
        self._leaves: list[tuple[int, int]] = []  # (stamp, page): idle leaves, lazily pruned
        self._clock = 0
        self.version = 0  # bumped when a page enters or leaves the index: a match may differ

    def __contains__(self, page: int) -> bool:
        return page in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def evictable(self) -> int:
        """Index-only pages eviction can reach; by the chain rule above, all cached pages."""
        return self.pool.cached

    def node(self, page: int) -> Node:
        return self._nodes[page]

    def page_key(self, tokens: Sequence[int], index: int) -> Key:
        start = index * self.page_size
        return tuple(tokens[start : start + self.page_size])

    # ---- read side: never re-stamps ------------------------------------------------------------

    def match(
        self, label: str, tokens: Sequence[int], max_pages: int, after: Sequence[int] = ()
    ) -> list[int]:
        """Pages of the longest cached prefix of `tokens` in `label`, at most `max_pages`.
        `after` is a chain already matched (and held), from which the walk resumes, so a
        waiting request is re-peeked in O(new pages) each step."""
        children = self._roots.get(label)
        if after:
            children = self._nodes[after[-1]].children
        pages = list(after)
        while children is not None and len(pages) < max_pages:
            node = children.get(self.page_key(tokens, len(pages)))
            if node is None:
                break
            pages.append(node.page)
            children = node.children
        return pages

    # ---- write side ----------------------------------------------------------------------------

    def insert(self, label: str, parent: int | None, key: Key, page: int) -> bool:
        """Index a held page under `parent` (None: a first page). Returns False, changing
        nothing, when that prefix is already indexed by another page (two requests computed it
        at once); the caller then stops indexing that chain."""
        if self.pool.refcount[page] == 0:
            raise InvariantBreach(f"page {page} is indexed while nobody holds it")
        if parent is None:
            siblings = self._roots.setdefault(label, {})
            parent_node = None
        else:
            parent_node = self._nodes.get(parent)
            if parent_node is None:
                raise InvariantBreach(f"page {page} is chained under unindexed page {parent}")
            if self.pool.refcount[parent] == 0:
                raise InvariantBreach(
                    f"page {page} would chain under page {parent}, which only the index holds: "
                    f"eviction could never reach it"
                )
            siblings = parent_node.children
        if key in siblings or page in self._nodes:
            return False
        self._clock += 1
        self.version += 1
        node = Node(page, label, key, parent_node, self._clock)
        if self.digests:
            node.digest = chain_digest(parent_node.digest if parent_node else None, label, key)
        siblings[key] = node
        self._nodes[page] = node
        return True

    def touch(self, pages: Collection[int]) -> None:
        """A use: leased, or released after use. Re-stamps for LRU; a peek must not call this."""
        self._clock += 1
        for page in pages:
            node = self._nodes.get(page)
            if node is not None:
                node.stamp = self._clock

    def on_idle(self, page: int) -> None:
        """The pool's last reference to an indexed page went away: it may now be evicted."""
        node = self._nodes[page]
        if not node.children:
            heapq.heappush(self._leaves, (node.stamp, page))

    def evict(self, protected: Collection[int] = ()) -> int:
        """Evict the least recently used idle leaf, returning its page to the free list. Pages in
        `protected` (what the waiting head will reuse) go only once no other idle page is left;
        since a protected set is a chain from the root, no unprotected idle page sits above one,
        so taking the others first never has to touch them."""
        stashed: list[tuple[int, int]] = []
        victim: int | None = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            stamp, page = entry
            node = self._nodes.get(page)
            if node is None or node.stamp != stamp or node.children or self.pool.refcount[page]:
                continue  # stale: re-stamped, held again, grew a child, or evicted already
            if page in protected:
                stashed.append(entry)
                continue
            victim = page
            break
        if victim is None and stashed:
            stashed.sort()
            victim = stashed.pop(0)[1]
        for entry in stashed:
            heapq.heappush(self._leaves, entry)
        if victim is None:
            raise OutOfPages("no free page and no idle cached page to evict")
        if self.spill is not None:
            self.spill(self._nodes[victim])
        self._remove(victim)
        return victim

    def _remove(self, page: int) -> None:
        self.version += 1
        node = self._nodes.pop(page)
        parent = node.parent
        siblings = parent.children if parent is not None else self._roots[node.label]
        del siblings[node.key]
        self.pool.reclaim(page)
        if parent is not None and not parent.children and self.pool.refcount[parent.page] == 0:
            heapq.heappush(self._leaves, (parent.stamp, parent.page))

    # ---- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Deep check (O(index)): every indexed page below an index-only page is index-only too,
        and the pool's cached count is exactly the index-only pages."""
        idle = 0
        for page, node in self._nodes.items():
            held = self.pool.refcount[page] > 0
            idle += not held
            parent = node.parent
            if held and parent is not None and self.pool.refcount[parent.page] == 0:
                raise InvariantBreach(
                    f"held page {page} sits below page {parent.page}, which only the index "
                    f"holds: eviction cannot reach that page"
                )
        if idle != self.pool.cached:
            raise InvariantBreach(
                f"the index has {idle} idle pages but the pool counts {self.pool.cached} cached"
            )
