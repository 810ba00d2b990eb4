"""The order in which the plug-in's waiting strict requests meet the ledger (`KVBANK_ORDER`).

- `fifo` (the default): arrival order.
- `prefix`: before each admission pass, a waiting request whose prompt's first block no
  admitted strict request holds goes behind those whose first block one holds, each group in
  arrival order. On a pool that holds one long shared prefix with room beside it but not two,
  arrival order alternates between prefixes, so both stay held and the second prefix's blocks
  are room no request's own tokens use; asking the held prefix's requests first keeps one
  prefix in the pool while its requests fill it (docs/benchmarks.md, "Packing and host time").

Order changes only who is asked first. Every admission still passes the ledger's test, so no
promise to a running request changes. Nothing starves: a request that has waited
`max_defer_steps` admission passes (one a schedule while requests wait) is never moved again.
Every request ahead of it then is older and never moved either, so it reaches the head of the
ledger's queue as in arrival order, where the ledger's own rule starts it (the head is admitted
when it fits, and a refused head's promise is never delayed): docs/admission.md.

The ledger's queue is reordered with the ledger's own events: a moved request is cancelled
and submitted again, with the same pages and shape, which queues it last. The embedded ledger
(or a sidecar each schedule waits on) answers every call at once. Over a sidecar the schedule
never waits on, the plug-in reorders only while no report is in flight, so no decision on its
way names a request being moved; the events go, in order, with the next report, and a moved
head's pinned hit is unpinned with its cancel (kvbank.vllm.admission, kvbank.vllm.pins).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice
from typing import Any

from kvbank.ledger.client import LedgerClient
from kvbank.modelpool import Admission

DEFAULT_ORDER = Admission.order
DEFAULT_MAX_DEFER_STEPS = 2048
# A pass looks at the first this many waiting requests: the ledger asks the head and a few
# behind it each pass, and each move is two ledger events (a sidecar's report carries them),
# so a long queue costs a pass at most this many moves, not one per waiting request.
REORDER_WINDOW = 128


def first_block(request: Any) -> Any:
    """The hash of a vLLM request's first prompt block (None: its prompt has no full block)."""
    hashes = request.block_hashes
    return hashes[0] if hashes else None


class PrefixOrder:
    """`KVBANK_ORDER=prefix` over one ledger (the module docstring)."""

    def __init__(self, max_defer_steps: int) -> None:
        self.max_defer_steps = max_defer_steps
        self.steps = 0  # admission passes so far
        self.moved = 0  # requests moved behind others, in all
        # Each queued request's arrival pass and what it was submitted with (pages, shape).
        self._queued: dict[str, tuple[int, int, Any]] = {}

    def queued(self, rid: str, pages: int, shape: Any) -> None:
        """A strict request was submitted to the ledger."""
        self._queued[rid] = (self.steps, pages, shape)

    def reorder(
        self, waiting: OrderedDict[str, Any], admitted: Iterable[Any], backend: LedgerClient
    ) -> list[str]:
        """Move the waiting requests whose first block no `admitted` entry's request holds
        behind the others of the first `REORDER_WINDOW`, to the queue's end, in `waiting` and in
        the ledger's queue, before a pass; the moved ids, in their order."""
        self.steps += 1
        self._queued = {rid: v for rid, v in self._queued.items() if rid in waiting}  # left
        holding = {first_block(entry.request) for entry in admitted} - {None}
        if not holding:
            return []
        back, stays_behind = [], False
        for rid, request in islice(waiting.items(), REORDER_WINDOW):
            if self._defers(rid, request, holding):
                back.append(rid)
            elif back:
                stays_behind = True
        if not stays_behind:
            return []  # already last: nothing moves
        for rid in back:
            _, pages, shape = self._queued[rid]
            backend.cancel(rid)
            backend.submit(rid, pages, shape=shape)
            waiting.move_to_end(rid)
        self.moved += len(back)
        return back

    def _defers(self, rid: str, request: Any, holding: set[Any]) -> bool:
        arrived = self._queued[rid][0]
        if self.steps - arrived >= self.max_defer_steps:
            return False  # waited long enough: it keeps its place
        block = first_block(request)
        return block is not None and block not in holding


class FifoOrder:
    """`KVBANK_ORDER=fifo`: the ledger's queue stays in arrival order."""

    moved = 0

    def queued(self, rid: str, pages: int, shape: Any) -> None:
        pass

    def reorder(self, waiting: Any, admitted: Any, backend: Any) -> list[str]:
        return []


def make_order(order: str, max_defer_steps: int) -> PrefixOrder | FifoOrder:
    """The order `KVBANK_ORDER` names (kvbank.vllm.settings checked it)."""
    return PrefixOrder(max_defer_steps) if order == "prefix" else FifoOrder()
