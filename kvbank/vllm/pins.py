"""The waiting head's cached blocks, pinned while a sidecar the schedule never waits on decides
on it (kvbank.vllm.admission sends a report each step and applies its answer a step or more
later).

A decision on its way may admit the head with the blocks pinned when it was reported as its hit,
so those blocks must not be evicted before it arrives: they are pinned (their reference count
raised) within the ledger's headroom, only while no decision is in flight, and held here until
the decision is applied, when the admitted request keeps the ones its hit counted, or until the
request leaves. Blocks given back by the pins of requests that left while a report was in flight
stay out of the supply the ledger hears until every answer is known (`unpinned_in_flight`).
A block's holders are counted as the supply the ledger hears counts them (`holders`,
kvbank.vllm.classes.Classes.strict_holders: strict requests and pins; best-effort ones do not
keep a block out of it). What the ledger is told of a pin is kvbank.vllm.admission's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kvbank.ledger import InvariantBreach
from kvbank.vllm.groups import Tables, flat


class Pinned(NamedTuple):
    """What one `HeadPins.pin` did: the pages of headroom it cost, the blocks pinned for the
    head now (its hit), and whether a new pin shares a block a running request held alone."""

    cost: int
    blocks: int
    shared: bool


class HeadPins:
    """Per waiting request, per group, the cached blocks pinned for it until its decision is
    applied."""

    def __init__(self, pool: Any, tables: Tables, steady: list[bool], peak: bool) -> None:
        self.pool = pool  # vllm.v1.core.block_pool.BlockPool
        self.tables = tables
        self.steady = steady
        self.groups = len(steady)
        self.peak = peak
        self._pins: dict[str, list[list[Any]]] = {}
        # Blocks freed by unpinning requests that left while a report was in flight: its answer
        # may admit them with those pins as their hit, which the ledger then counts as held
        # until the release that follows the answer. Until every answer is known they stay out
        # of the supply the ledger hears, as they were while pinned.
        self.unpinned_in_flight = 0

    def __contains__(self, rid: str) -> bool:
        return bool(self._pins.get(rid))

    def pin(self, head: Any, budget: int, holders: Callable[[Any], int]) -> Pinned | None:
        """Pin more of the head's computed blocks, in prefix order, within `budget` pages of
        headroom: a block only the cache held (free to vLLM) leaves the supply, and one a
        single running request holds no longer returns when it finishes; each costs a page.
        With several groups (or a window's) the hit is pinned whole or not at all, once: a
        longer hit moves a window, so its blocks are not a prefix of the shorter hit's. None:
        nothing more was pinned."""
        pinned = self._pins.setdefault(head.request_id, [[] for _ in range(self.groups)])
        hit = self.tables.hit(head)
        new: list[list[Any]] = [[] for _ in range(self.groups)]
        spent = 0
        if self.groups == 1 and self.steady[0]:
            for block in hit[0][len(pinned[0]) :]:
                cost = _pin_cost(holders(block), self.peak, self.steady[0])
                if spent + cost > budget:
                    break
                spent += cost
                new[0].append(block)
        elif not flat(pinned):
            spent = sum(
                _pin_cost(holders(block), self.peak, keep)
                for group, keep in zip(hit, self.steady, strict=True)
                for block in group
            )
            if spent <= budget:
                new = hit
        if not flat(new):
            return None
        shared = any(holders(block) == 1 for block in flat(new))
        self.pool.touch(flat(new))
        for group, more in zip(pinned, new, strict=True):
            group += more
        return Pinned(spent, len(flat(pinned)), shared)

    def keep(self, rid: str, hit: int) -> list[list[Any]]:
        """The pins a request admitted with a `hit`-block hit keeps, per group (it was decided on
        an earlier report, so on fewer pins or none); the others are dropped."""
        pins = self._pins.pop(rid, [[] for _ in range(self.groups)])
        pinned = len(flat(pins))
        whole = self.groups > 1 or not self.steady[0]
        if hit > pinned or (whole and hit not in (0, pinned)):
            raise InvariantBreach(
                f"request {rid!r} was admitted with a {hit}-block hit but {pinned} blocks are "
                f"pinned for it"
            )
        if self.groups == 1 and self.steady[0]:
            kept = [pins[0][:hit]]
        else:
            kept = pins if hit else [[] for _ in pins]
        dropped = [b for group, keep in zip(pins, kept, strict=True) for b in group[len(keep) :]]
        if dropped:
            self.pool.free_blocks(dropped)
        return kept

    def unpin(self, rid: str, in_flight: bool, holders: Callable[[Any], int] | None = None) -> None:
        """Drop every pin of a request that left, or that the order moved back while no
        decision was in flight (kvbank.vllm.order: the cancel that moved it made the ledger
        forget its hit). `in_flight`: a report is on its way, whose answer may admit it with
        those pins as its hit; `holders` then counts what comes back to the supply."""
        pins = self._pins.pop(rid, None)
        if not pins:
            return
        if in_flight:
            assert holders is not None
            self.unpinned_in_flight += sum(1 for b in flat(pins) if holders(b) == 1)
        self.pool.free_blocks(flat(pins))

    def settle(self) -> None:
        """Every answer is known: a request that left was either admitted, and released ahead
        of the next supply, or never will be."""
        self.unpinned_in_flight = 0

    def window_ids(self) -> list[list[int]]:
        """Per pinning request, the ids of its pinned blocks in window or state groups: copies
        the supply the ledger hears is lowered by (kvbank.vllm.groups.window_overlap)."""
        return [
            [b.block_id for group, keep in zip(pins, self.steady, strict=True)
             if not keep for b in group]
            for pins in self._pins.values()
        ]  # fmt: skip


def _pin_cost(holders: int, peak: bool, steady: bool) -> int:
    """A page of headroom for a block no strict request or pin holds (`holders`: it leaves the
    supply, free or reclaimable), for any block of a window or state group (kvbank.vllm.groups:
    a copy is a page) and, under peak-fit, for one a single strict request holds (it no
    longer returns when that request finishes)."""
    return 1 if not steady or holders == 0 or (holders == 1 and peak) else 0
