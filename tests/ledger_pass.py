"""An admission pass over a bare `Ledger` for the tests that drive one directly: ask about every
waiting request in the ledger's own order (`ask_in_order`, the pass every host runs), each with
the hit `peek` gives it (None: it cannot start now), and return the admissions."""

from __future__ import annotations

from collections.abc import Callable

from kvbank.ledger import NO_HIT, Admitted, Hit, Ledger
from kvbank.ledger.client import ask_in_order


def admit_all(
    ledger: Ledger,
    peek: Callable[[str], Hit | None] = lambda rid: NO_HIT,
    started: Callable[[Admitted], None] | None = None,
    deferred: bool = False,
) -> list[Admitted]:
    """Every admission one pass makes; `started(decision)` runs after each, before the next
    question."""

    class Deferred:
        def try_admit(
            self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
        ) -> Admitted | None:
            # Every pass checks `refuses_behind` against the answer, with the tightest bound (the
            # hit's own held part): a refusal it foresees must be the ledger's answer.
            foreseen = (
                hit is not None
                and not deferred
                and ledger.refuses_behind(rid, hit.pages - hit.idle_pages, prefill_chunks)
            )
            decision = ledger.try_admit(rid, hit, prefill_chunks, deferred=deferred)
            assert not (foreseen and decision is not None), (
                f"refuses_behind foresaw {rid!r} refused with {hit}, and it was admitted"
            )
            return decision

        def backfilling(self) -> bool:
            return ledger.backfilling()

        def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
            return ledger.refuses_behind(rid, most_held, prefill_chunks)

    depth = ledger.policy.backfill_depth if ledger.policy is not None else 0
    admitted = []
    for _, decision in ask_in_order(
        Deferred(), ledger.waiting_rids, str, lambda rid: (peek(rid), None), depth
    ):
        admitted.append(decision)
        if started is not None:
            started(decision)
    return admitted
