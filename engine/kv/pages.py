"""The page pool: integer page ids, a free list and reference counts, with no tensors.

Every usable page is in exactly one state, kept as running totals so that the scheduler never
scans the pool:

    free    on the free list, owned by nobody
    held    referenced by at least one request (or pinned for a waiting one)
    cached  referenced by nobody, kept only because the prefix index maps a prefix to it

Page 0 is the sink page: padding rows and labels a request never reads write there. It is never
allocated, never freed and never counted as supply.
"""

from __future__ import annotations

from kvbank.capacity import SINK_PAGES
from kvbank.ledger import InvariantBreach, pool_usable_pages

SINK_PAGE = 0


class OutOfPages(Exception):
    """No free page is left; the caller evicts, preempts or stalls, and nothing was changed."""


class PagePool:
    """Free list plus reference counts. Allocation pops from a list (O(1)); a page freed last is
    handed out first, which keeps recently touched memory warm on a real device."""

    def __init__(self, total_pages: int) -> None:
        self.usable_pages = pool_usable_pages(total_pages)  # raises for a pool without one
        self.total_pages = total_pages
        self.refcount = [0] * total_pages
        # Reversed so that page 1 is allocated first: tests can name exact page ids.
        self._free = list(range(total_pages - 1, SINK_PAGES - 1, -1))
        self.held = 0
        self.cached = 0

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free page and hold it once."""
        if not self._free:
            raise OutOfPages("no free page")
        page = self._free.pop()
        self.refcount[page] = 1
        self.held += 1
        return page

    def hold(self, page: int) -> None:
        """One more reference to a page that is held or cached (a prefix hit being leased)."""
        count = self.refcount[page]
        if count == 0:
            self.cached -= 1
            self.held += 1
        self.refcount[page] = count + 1

    def drop(self, page: int, indexed: bool) -> bool:
        """One reference less. Returns True when the page is now unreferenced: it becomes cached
        when the prefix index maps it (`indexed`), free otherwise."""
        count = self.refcount[page] - 1
        if count < 0:
            raise InvariantBreach(f"page {page} dropped more often than it was held")
        self.refcount[page] = count
        if count:
            return False
        self.held -= 1
        if indexed:
            self.cached += 1
        else:
            self._free.append(page)
        return True

    def reclaim(self, page: int) -> None:
        """A cached page the prefix index evicted goes back to the free list."""
        if self.refcount[page]:
            raise InvariantBreach(f"page {page} is evicted while {self.refcount[page]} hold it")
        self.cached -= 1
        self._free.append(page)

    def check_integrity(self, deep: bool = False) -> None:
        """free + held + cached == usable pages, and (deep) the counts match the page states."""
        if self.free + self.held + self.cached != self.usable_pages:
            raise InvariantBreach(
                f"free {self.free} + held {self.held} + cached {self.cached} != "
                f"{self.usable_pages} usable pages"
            )
        if not deep:
            return
        free = set(self._free)
        if len(free) != len(self._free) or SINK_PAGE in free:
            raise InvariantBreach("the free list repeats a page or holds the sink page")
        held = sum(1 for count in self.refcount if count > 0)
        if held != self.held or self.refcount[SINK_PAGE]:
            raise InvariantBreach(f"{held} pages are referenced but the pool counts {self.held}")
        if any(self.refcount[p] for p in free):
            raise InvariantBreach("a page on the free list is referenced")
