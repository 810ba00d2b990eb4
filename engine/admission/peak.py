"""Peak-fit admission in the engine: `peak`, `peak+backfill` and `banker+backfill` (the
conservative reading with EASY backfill).

The ledger (kvbank.ledger with a kvbank.ledger.PeakPolicy) sits behind a `PeakBackend`,
reached one of two ways.

- In step (the embedded ledger, and `kvbank bench --sidecar`'s blocking sidecar): one pass asks
  for each candidate's hit in turn and the engine starts each admission before the next
  question; a head's hit is peeked and leased in the same pass, nothing is pinned.
- Deferred (a served engine over its sidecar): the step never waits. As the banker does, the
  engine pins the head's cached hit and reports it; the sidecar decides when the report reaches
  it and the engine applies the decisions a step or more later, reporting each `start`. Until
  then the ledger keeps the admission open-ended (it may start at any later step; see
  kvbank.ledger.open_ended), so the delay cannot break a promise. A pin takes pages off
  the supply (its idle pages) and off the returns of a request that held a page alone, so it
  spends at most the ledger's headroom (`PeakBackend.headroom`), and the holders' exact
  exclusive counts go with the same report as the hit. Requests admitted behind the head (a
  second head, backfill) come with no hit and start without a lease, as the banker's do.

The bound the ledger relies on is the scheduler's to keep (see kvbank.engine.scheduler): every
running request gets a decode row every step, and prefill rows are served oldest first; this
policy keeps the running set below the token budget, so prefill gets at least
`max_batch_tokens - running cap` tokens a step. So a request admitted behind `T` pending
prefill tokens (its own prompt included) finishes its prefill within ceil(T / that) + 1 steps;
that is the bound it is admitted with. After each step every running request's progress goes to
the ledger; one that made none (or a prefill past its bound) is reported as stalled, counted in
`stalled_steps`, logged, and the ledger admits conservatively until every request advances again.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import cast

import kvbank.engine.admission.banker
import kvbank.engine.admission.baselines  # noqa: F401  (registered first: `all` keeps banker first)
from kvbank.engine.admission.backend import AdmissionBackend, PeakBackend, embedded
from kvbank.engine.admission.decisions import DecisionReader, HeadPin, pinned_chains
from kvbank.engine.admission.policy import AdmissionPolicy, register
from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request
from kvbank.engine.scheduler import Scheduler
from kvbank.ledger import (
    Admitted,
    Decision,
    Hit,
    InvariantBreach,
    PeakPolicy,
    PeakShape,
    UnknownRequest,
    peak_shape,
)

log = logging.getLogger(__name__)


class PeakFitPolicy(AdmissionPolicy):
    def __init__(
        self, name: str, peak: bool, backfill: bool, backend: PeakBackend | None = None
    ) -> None:
        self.name = name
        self.peak = peak
        self.backfill = backfill
        self._given = backend  # None: an embedded ledger, built once the pool is known
        self.stalled_steps = 0
        self._shapes: dict[str, PeakShape] = {}  # waiting request -> the shape last sent
        self._chunks: dict[str, int] = {}  # running request -> prefill steps it may still take
        self._chains: dict[str, Chains] = {}  # hits peeked in this pass, leased at admission
        # Set when pages changed hands between requests (a shared hit leased, or a co-holder
        # left); the next end_step then counts every request's exclusive pages afresh.
        self._sharing_changed = False
        self._pin = HeadPin()  # deferred: the head's hit, pinned and reported
        self._reader = DecisionReader()  # deferred: decisions applied once, in order

    def bind(self, sched: Scheduler) -> None:
        super().bind(sched)
        model = sched.model
        # A decode row writes one token and allocates speculative_tokens positions past it.
        policy = PeakPolicy(
            model.page_size,
            model.speculative_tokens,
            self.peak,
            self.backfill,
            backfill_depth=32,
            max_advance=1,
        )
        if self._given is None:
            self.backend: PeakBackend = embedded(sched.kv.pool.total_pages, policy=policy)
        else:
            self.backend = self._given
            self.backend.configure(self.name, policy)
        # Decode rows take the budget first; capping the running set below the budget leaves
        # every step at least `prefill_rate` tokens for prefill, which bounds a prefill.
        budget = sched.max_batch_tokens
        self.running_cap = max(1, min(sched.max_running, budget - 1))
        self.prefill_rate = max(1, budget - self.running_cap)

    # ---- arrivals and admission ----------------------------------------------------------------

    def on_arrival(self, req: Request) -> None:
        # The growth per label is the engine's own count (kvbank.capacity), never a client's.
        shape = peak_shape(self.sched.model, req.shape)
        self._shapes[req.rid] = shape
        self.backend.submit(req.rid, req.count.total, shape=shape)

    def on_cancel(self, req: Request) -> None:
        self._shapes.pop(req.rid, None)
        self._pin.forget(req.rid)
        self.sched.kv.unpin(req)
        # A deferred ledger may have admitted it already: `_apply` releases that admission.
        with contextlib.suppress(UnknownRequest):
            self.backend.cancel(req.rid)

    def _prefill_bound(self, req: Request) -> int:
        """Steps the request's prefill may take if admitted now: every prefill token ahead of
        it, and its own, at the guaranteed rate, plus the admission step (which may have no
        budget left for it)."""
        ahead = sum(
            r.num_tokens - r.num_computed
            for r in self.sched.running.values()
            if r.rid in self._chunks
        )
        return -(-(ahead + req.num_tokens) // self.prefill_rate) + 1

    def _peek(self, rid: str) -> Hit | None:
        sched = self.sched
        req = sched.waiting_by_rid.get(rid)
        if req is None or not sched.can_start() or len(sched.running) >= self.running_cap:
            return None
        shape = self._shapes[rid]  # on_arrival submits every request with its shape
        chunks = self._prefill_bound(req)
        if shape.prefill_chunks != chunks:
            self._shapes[rid] = replace(shape, prefill_chunks=chunks)
            self.backend.set_prefill_chunks(rid, chunks)
        chains = sched.kv.peek(req)
        self._chains[rid] = chains
        refcount = sched.kv.pool.refcount
        sole = sum(1 for chain in chains.values() for page in chain if refcount[page] == 1)
        return Hit(sum(len(c) for c in chains.values()), sched.kv.idle_pages(chains), sole)

    def _started(self, decision: Admitted) -> None:
        sched = self.sched
        req = sched.waiting_by_rid.get(decision.rid)
        if req is None:
            raise InvariantBreach(f"request {decision.rid!r} was admitted but is not waiting")
        if isinstance(decision, Admitted) and decision.reserved != req.count.total:
            raise InvariantBreach(
                f"request {req.rid!r} was admitted for {decision.reserved} pages but the "
                f"engine counts {req.count.total}"
            )
        self._shapes.pop(req.rid, None)
        waiting_chunks = self._prefill_bound(req)
        sched.start(req, self._chains.pop(decision.rid))
        self._chunks[req.rid] = waiting_chunks
        if decision.hit.pages > decision.hit.idle_pages:
            self._sharing_changed = True

    def admit(self) -> None:
        self._sync_supply()
        backend = self.backend
        if backend.defers:
            self._apply(backend.collect())
            if backend.settled():
                self._pin_head()
                self._sync_supply()
            self._apply(backend.poll(max(0, self.running_cap - len(self.sched.running))))
            return
        self.backend.admit_pass(self._peek, self._started)
        self._chains.clear()

    # ---- deferred decisions (a sidecar the step does not wait on) -------------------------------

    def _pin_head(self) -> None:
        backend = self.backend
        new = self._pin.grow(self.sched, backend, backend.headroom, sole_costs=True)
        if not new:
            return
        # What the new pins cost: idle pages left the supply, and a page one running request
        # held alone no longer returns when that request finishes (now shared with the pin).
        refcount = self.sched.kv.pool.refcount
        backend.note_pin(sum(1 for page in new if refcount[page] <= 2))
        if any(refcount[page] == 2 for page in new):
            for req in self.sched.running.values():
                backend.set_exclusive(req.rid, self._exclusive(req))

    def _apply(self, decisions: list[Decision]) -> None:
        sched = self.sched
        reader, forget = self._reader, self._pin.forget
        for req, decision in reader.admissions(sched, self.backend, decisions, forget):
            if len(sched.running) >= self.running_cap:
                raise InvariantBreach(
                    f"request {req.rid!r} was admitted beyond the room the engine reported: "
                    f"{len(sched.running)} run, the cap is {self.running_cap}"
                )
            self._shapes.pop(req.rid, None)
            chunks = self._prefill_bound(req)
            self.backend.start(req.rid, chunks)  # before the prompt's pages are taken
            sched.start(req, pinned_chains(req))
            self._chunks[req.rid] = chunks
            if decision.hit.pages:
                self._sharing_changed = True

    # ---- pages ---------------------------------------------------------------------------------

    def on_shortage(self, req: Request) -> Request | None:
        raise InvariantBreach(
            f"request {req.rid!r} could not grow under {self.name}: it holds {req.held} of its "
            f"{req.count.total} reserved pages, supply is {self.sched.kv.supply}"
        )

    def on_take(self, req: Request, pages: int) -> None:
        self.backend.take(req.rid, pages)

    def on_release(self, req: Request) -> None:
        self._chunks.pop(req.rid, None)
        self.backend.release(req.rid)
        if any(r.hit_pages for r in self.sched.running.values()):
            self._sharing_changed = True

    def _exclusive(self, req: Request) -> int:
        """Pages only this request holds. Only pages in the prefix index can be shared (a
        leased hit, or a prompt page another request leased since), so only those are looked
        at: O(indexed pages)."""
        refcount = self.sched.kv.pool.refcount
        shared = sum(
            1 for table in req.pages.values() for page in table[: req.indexed] if refcount[page] > 1
        )
        return req.held - shared

    def end_step(self) -> None:
        """Report every running request's progress, then close the step in the ledger."""
        sched, backend = self.sched, self.backend
        recount, self._sharing_changed = self._sharing_changed, False
        for req in sched.running.values():
            row = sched.rows.get(req.rid)
            chunks = self._chunks.get(req.rid)
            if chunks is not None:  # in prefill: the bound counts down, progress or not
                if req.num_computed >= len(req.prompt):
                    del self._chunks[req.rid]
                    chunks = 0
                elif chunks <= 1:
                    continue  # past its bound: stalled
                else:
                    chunks -= 1
                    self._chunks[req.rid] = chunks
            elif row is None:
                continue  # a decode row was skipped: stalled
            # Tokens whose KV is written (the last sampled token is not yet): the timeline's
            # next step writes the one after them.
            written = {
                lay.name: lay.tokens_at(req.num_computed, len(req.prompt)) for lay in req.layout
            }
            exclusive = self._exclusive(req) if recount else None
            backend.advance(req.rid, len(req.output), written, chunks or 0, exclusive)
        self._sync_supply()
        stalled = backend.end_step()
        if stalled:
            log.warning(
                "%s: %d running request(s) made no progress this step; admitting "
                "conservatively until all advance",
                self.name,
                len(stalled),
            )

        self.stalled_steps = backend.stalled_steps()

    def _sync_supply(self) -> None:
        kv = self.sched.kv
        self.backend.set_supply(kv.free, kv.evictable)  # a no-op when the figures are unchanged

    def check_integrity(self) -> None:
        kv = self.sched.kv
        self.backend.check_integrity(kv.free, kv.evictable)


def _factory(name: str, peak: bool, backfill: bool):  # type: ignore[no-untyped-def]
    def make(backend: AdmissionBackend | None) -> AdmissionPolicy:
        return PeakFitPolicy(name, peak, backfill, cast("PeakBackend | None", backend))

    return make


register("peak", _factory("peak", True, False))
register("peak+backfill", _factory("peak+backfill", True, True))
register("banker+backfill", _factory("banker+backfill", False, True))
