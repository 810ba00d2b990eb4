"""The ledger's books: the waiting queue, the running reservations, the running total
`outstanding` and the pool's `supply`, kept so that admission is one comparison
(kvbank/ledger/ledger.py), and the checks on every argument before a change.

An argument check raises before anything moved, so the books are unchanged when a LedgerError
comes out of one. The invariant check (`check_conservative`) raises InvariantBreach with the
numbers: a breach means the ledger promised pages the pool cannot give, and it names the request
with the largest claim."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

from kvbank.capacity import SINK_PAGES, usable_pages
from kvbank.fields import quote
from kvbank.ledger.shape import PeakShape
from kvbank.ledger.types import (
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    LedgerSnapshot,
    Reservation,
    UnknownRequest,
)


def pool_usable_pages(total_pages: int) -> int:
    """The pages of a pool of `total_pages` that requests can hold, checking that there are
    any: the one guard of the ledger's pool and the engine's page pool."""
    if total_pages <= SINK_PAGES:
        raise InvalidPages(
            f"a pool needs at least {SINK_PAGES + 1} pages (one is the sink), got {total_pages}"
        )
    return usable_pages(total_pages)


@dataclass
class Waiting:
    """A queued request: its worst-case pages, and its shape when a policy ledger follows it."""

    pages: int
    shape: PeakShape | None = None


class Books:
    """Reservations and totals; what reads them; the argument checks."""

    def __init__(
        self, total_pages: int, free: int = -1, evictable: int = 0, next_seq: int = 0
    ) -> None:
        self.total_pages = total_pages
        self.usable_pages = pool_usable_pages(total_pages)
        self.free = self.usable_pages if free < 0 else free  # -1: every usable page starts free
        self.evictable = evictable
        self.next_seq = next_seq
        self.waiting: OrderedDict[str, Waiting] = OrderedDict()
        self.running: dict[str, Reservation] = {}
        self.outstanding = 0

    @property
    def supply(self) -> int:
        return self.free + self.evictable

    @property
    def head(self) -> str | None:
        return next(iter(self.waiting), None)

    def reservation(self, rid: str) -> Reservation:
        try:
            return self.running[rid]
        except KeyError:
            raise UnknownRequest(f"request {quote(rid)} is not running") from None

    def waiting_entry(self, rid: str) -> Waiting:
        waiting = self.waiting.get(rid)
        if waiting is None:
            raise UnknownRequest(f"request {quote(rid)} is not waiting")
        return waiting

    def take_supply(self, pages: int) -> None:
        from_free = min(pages, self.free)
        self.free -= from_free
        self.evictable -= pages - from_free

    def snapshot(self) -> LedgerSnapshot:
        running = tuple(
            Reservation(r.rid, r.reserved, r.held, r.seq) for r in self.running.values()
        )
        return LedgerSnapshot(
            total_pages=self.total_pages,
            usable_pages=self.usable_pages,
            free=self.free,
            evictable=self.evictable,
            outstanding=self.outstanding,
            reserved=sum(r.reserved for r in running),
            held=sum(r.held for r in running),
            waiting=tuple((rid, w.pages) for rid, w in self.waiting.items()),
            running=running,
            next_seq=self.next_seq,
        )

    def copy(self) -> Books:
        """Independent books in the same state: O(waiting + running)."""
        twin = Books.__new__(Books)
        twin.__dict__.update(self.__dict__)
        twin.waiting = OrderedDict(
            (rid, Waiting(w.pages, w.shape)) for rid, w in self.waiting.items()
        )
        twin.running = {
            rid: Reservation(r.rid, r.reserved, r.held, r.seq) for rid, r in self.running.items()
        }
        return twin

    # ---- checks --------------------------------------------------------------------------------

    def check_totals(self) -> None:
        """Every request within its reservation, and `outstanding` their sum."""
        total = 0
        for res in self.running.values():
            if res.held > res.reserved:
                raise InvariantBreach(
                    f"request {quote(res.rid)} holds {res.held} pages but reserved {res.reserved}"
                )
            total += res.reserved - res.held
        if total != self.outstanding:
            raise InvariantBreach(
                f"outstanding total {self.outstanding} != sum of reserved - held {total}"
            )

    def check_conservative(self) -> None:
        """The conservative safe state: every admitted request can take every page it may
        need at once."""
        if self.outstanding > self.supply:
            worst = max(self.running.values(), key=lambda r: r.reserved - r.held, default=None)
            raise InvariantBreach(
                f"outstanding {self.outstanding} pages exceed supply {self.supply} (free "
                f"{self.free} + evictable {self.evictable}); largest claim: "
                f"{quote(worst.rid if worst else '-')} with "
                f"{(worst.reserved - worst.held) if worst else 0} pages still to take"
            )

    def check_new(self, rid: str) -> None:
        if not isinstance(rid, str) or not rid:
            raise InvalidPages(f"a request id must be a non-empty string, got {quote(rid)}", "rid")
        if rid in self.waiting or rid in self.running:
            raise DuplicateRequest(f"request {quote(rid)} is already known")

    def check_pages(self, pages: int, name: str, bounded: bool = True) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise InvalidPages(f"{name} must be a non-negative integer, got {quote(pages)}", name)
        if bounded and pages > self.total_pages:
            raise InvalidPages(f"{name}={pages} exceeds the pool's {self.total_pages} pages", name)

    def keep_chunks(self, waiting: Waiting, prefill_chunks: int | None) -> None:
        """Keep a waiting request's worst-case prefill steps if admitted now in its shape."""
        if prefill_chunks is None:
            return
        self.check_pages(prefill_chunks, "prefill_chunks", bounded=False)
        if waiting.shape and waiting.shape.prefill_chunks != prefill_chunks:
            waiting.shape = replace(waiting.shape, prefill_chunks=prefill_chunks)

    def check_give_back(
        self, rid: str, held: int, reserved: int, shape: PeakShape | None
    ) -> Reservation:
        """The running request that may give back `reserved` pages of which `held` held: 0 <=
        held <= reserved, at most what it holds and may still take, and a shape of what still
        runs that counts what stays reserved."""
        res = self.reservation(rid)
        self.check_pages(held, "held")
        self.check_pages(reserved, "reserved")
        if held > reserved or held > res.held or reserved - held > res.reserved - res.held:
            raise InvalidPages(
                f"request {quote(rid)} holds {res.held} of its {res.reserved} reserved pages; it "
                f"cannot give back {reserved} reserved pages of which {held} held (held <= "
                f"reserved, and at most what it holds and what it may still take)"
            )
        if shape is not None and shape.pages != res.reserved - reserved:
            raise InvalidPages(
                f"request {quote(rid)}: the shape of what still runs counts {shape.pages} "
                f"worst-case pages but {res.reserved - reserved} stay reserved; build both "
                f"from the same count"
            )
        return res

    def check_hit(self, hit: Hit, pages: int) -> None:
        if not 0 <= hit.idle_pages <= hit.pages <= pages:
            raise InvalidPages(
                f"a hit must satisfy 0 <= idle {hit.idle_pages} <= pages "
                f"{hit.pages} <= the request's {pages} pages"
            )
        if hit.sole_pages is not None and not 0 <= hit.sole_pages <= hit.pages - hit.idle_pages:
            raise InvalidPages(
                f"a hit's sole-held pages ({hit.sole_pages}) must be among its "
                f"{hit.pages - hit.idle_pages} held pages"
            )
        if hit.idle_pages > self.evictable:
            raise InvalidPages(
                f"hit leases {hit.idle_pages} idle pages but only {self.evictable} are evictable"
            )
