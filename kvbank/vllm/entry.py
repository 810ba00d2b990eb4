"""A request kvbank admitted over vLLM, as the ledger counts it (`Entry`), from its admission to
its release: the pages it holds per group (kvbank.vllm.groups.Holding), its cached hit pinned
until vLLM holds it, and under peak-fit the prefill steps its bound still allows.

kvbank.vllm.admission keeps one per admitted request and tells the ledger what they answer; an
entry changes only itself and, when its pin goes, vLLM's block pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbank.vllm.groups import Holders, Holding, Tables, flat


@dataclass
class Entry:
    """An admitted request, as the ledger counts it."""

    request: Any  # vllm.v1.request.Request
    holding: Holding  # pages the ledger counts as held, per group (hit, then vLLM's blocks)
    pin: list[list[Any]] = field(default_factory=list)  # per group, the hit pinned until vLLM
    # holds it
    chunks: int | None = None  # peak-fit: prefill steps it may still take (None: prefilled)

    @property
    def pinned(self) -> list[Any]:
        return flat(self.pin)

    def unpin(self, pool: Any) -> None:
        """Drop the pin (vLLM holds the hit now, or the request ended). Pinned blocks vLLM did
        not adopt (a window that a longer hit moved) stay counted as the request's, as freed
        ones do."""
        if self.pin:
            pool.free_blocks(self.pinned)
            self.pin = []

    def exclusive(self, tables: Tables, holders: Holders) -> int:
        """Pages that come back when this request finishes: those no other strict request (nor
        a pin) holds (a pinned hit counts as its own; `holders`: kvbank.vllm.groups `_read`),
        and those a window freed that the ledger still counts."""
        rid = self.request.request_id
        self.holding.recount(rid, self.pin if self.pin else tables.held(rid), holders)
        return self.holding.exclusive

    def step_done(self, scheduled: bool, prompt_end: int) -> bool:
        """Count a finished model step against the prefill bound; whether the request has
        progress to report (False: stalled, past its bound in prefill or, decoding, not
        `scheduled` in that step). `prompt_end`: the positions its prefill computes (a promoted
        request's output so far too, kvbank.vllm.classes)."""
        request = self.request
        if self.chunks is not None:  # in prefill: the bound counts down, progress or not
            if request.num_computed_tokens >= prompt_end:
                self.chunks = None
            elif self.chunks <= 1:
                return False  # past its bound: stalled
            else:
                self.chunks -= 1
        elif not scheduled:
            return False  # a decode step skipped: stalled
        return True
