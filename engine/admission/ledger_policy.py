"""Admission through the reservation ledger, one policy for every mode the ledger runs (kvbank/
mode.py): `banker` (the conservative sum of worst cases), `peak`, `peak+backfill` and
`banker+backfill`. The modes differ only inside the ledger, where the mode picks the timeline;
under `banker` the ledger follows no progress, so no shape, prefill bound or progress is sent.

The ledger sits behind a `LedgerClient` (kvbank/ledger/client.py), reached one of two ways.

- In step (the embedded ledger, and `kvbank bench --sidecar`'s blocking sidecar): one pass
  (`ask_in_order`) asks about each candidate in turn with its hit and the engine starts each
  admission before the next question; a hit is peeked and leased in the same pass, nothing is
  pinned.
- Deferred (a served engine over its sidecar): the step never waits. As the banker does, the
  engine pins the head's cached hit and reports it; the sidecar decides when the report reaches
  it and the engine applies the decisions a step or more later, reporting each `start`. Until
  then the ledger keeps the admission open-ended (it may start at any later step; see
  kvbank.ledger.open_ended), so the delay cannot break a promise. A pin takes pages off
  the supply (its idle pages) and off the returns of a request that held a page alone, so it
  spends at most the ledger's headroom (`LedgerClient.headroom`), and the holders' exact
  exclusive counts go with the same report as the hit. Requests admitted behind the head (a
  second head, backfill) come with no hit and start without a lease, as the banker's do.

The bound the ledger relies on is the scheduler's to keep (see engine/scheduler.py): every
running request gets a decode row every step, and prefill rows are served oldest first; this
policy keeps the running set below the token budget, so prefill gets at least
`max_batch_tokens - running cap` tokens a step. So a request admitted behind `T` pending
prefill tokens (its own prompt included) finishes its prefill within ceil(T / that) + 1 steps;
that is the bound it is admitted with. After each step every running request's progress goes to
the ledger; one that made none (or a prefill past its bound) is reported as stalled, counted in
`stalled_steps`, logged, and the ledger admits conservatively until every request advances again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

from kvbank.engine import sequences as groups
from kvbank.engine.admission.actions import Action, Preempt, Reject, Start
from kvbank.engine.admission.besteffort import BestEffort
from kvbank.engine.admission.decisions import LedgerParts
from kvbank.engine.admission.policy import AdmissionPolicy
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request
from kvbank.ledger import Admitted, Decision, Hit, InvariantBreach, PeakPolicy
from kvbank.ledger.client import LateAnswers, LedgerClient, ask_in_order, embedded
from kvbank.ledger.policy import PrefillPace
from kvbank.mode import AdmissionMode
from kvbank.service_class import ClassPolicy

log = logging.getLogger(__name__)


class LedgerPolicy(AdmissionPolicy):
    honours_classes = True  # best-effort requests run beside strict ones (besteffort.py)
    spares_head = True

    def __init__(
        self,
        mode: AdmissionMode,
        backend: LedgerClient | None = None,
        classes: ClassPolicy | None = None,
    ) -> None:
        self.classes = classes or ClassPolicy()
        self._parts = LedgerParts()
        self._reader, self._pin = self._parts.reader, self._parts.pin
        self.name = mode.name
        self.mode = mode
        self._given = backend  # None: an embedded ledger, built once the pool is known
        self.stalled_steps = 0
        self._chunks: dict[str, int] = {}  # running request -> prefill steps it may still take
        self._chains: dict[str, Chains] = {}  # hits peeked in this pass, leased at admission
        # Set when pages changed hands between requests (a shared hit leased, or a co-holder
        # left); the next end_step then counts every request's exclusive pages afresh.
        self._sharing_changed = False
        self._resumed_at: dict[str, int] = {}  # promoted request -> output when re-shaped

    def bind(self, view: AdmissionView) -> None:
        super().bind(view)
        model = view.model
        self.follows = self.mode.follows_progress
        # A decode row writes one token and allocates speculative_tokens positions past it.
        policy = None
        if self.follows:
            policy = PeakPolicy(
                model.page_size,
                model.speculative_tokens,
                self.mode.peak,
                self.mode.backfill,
                backfill_depth=32,
                max_advance=1,
            )
        self.backfill_depth = policy.backfill_depth if policy is not None else 0
        if self._given is None:
            self.backend: LedgerClient = embedded(view.kv.total_pages, policy=policy)
        else:
            self.backend = self._given
            if policy is not None:
                self.backend.configure(self.name, policy)
        # Decode rows take the budget first; capping the running set below the budget leaves
        # every step at least the pace's rate of tokens for prefill, which bounds a prefill.
        # The banker's promise rests on no bound: it runs as many as the engine does.
        self.pace = PrefillPace.of(view.max_running, view.max_batch_tokens)
        self.running_cap = self.pace.running_cap if self.follows else view.max_running
        self.best_effort = BestEffort(self.classes, view, self.running_cap)

    # ---- arrivals and admission ----------------------------------------------------------------

    def on_arrival(self, req: Request) -> None:
        if self.best_effort.arrive(req):
            return  # best-effort: never in the ledger's books
        # The shape is the engine's own count, made once at ingest (kvbank.engine.request).
        self.backend.submit(
            req.rid, req.count.total, shape=req.peak_shape if self.follows else None
        )

    def on_requeue(self, req: Request) -> None:
        if self.best_effort.requeue(req):
            if not self.follows:
                self.backend.submit(req.rid, req.count.total)  # promoted: strict from now on
                return
            # Promoted to strict for the rest of its life. The shape made at ingest would start
            # its curve below the output it already has: it is re-made from where it is (its
            # output counted as prompt, progress reported from there), or left out.
            shape = self.best_effort.resumed_shape(req)
            if shape is not None:
                req.peak_shape = shape
                self._resumed_at[req.rid] = len(req.output)
            self.backend.submit(req.rid, req.count.total, shape=shape)

    def head(self) -> Request | None:
        return self.best_effort.head()

    def _prefill_bound(self, req: Request) -> int:
        """Steps the request's prefill may take if admitted now: every prefill token ahead of
        it, and its own, at the guaranteed rate, plus the admission step (which may have no
        budget left for it). A group's other sequences start a step after the leader computed
        the shared prompt (that step's rest may go to later requests): one step more."""
        ahead = sum(
            groups.prefill_tokens(r) for r in self.view.running.values() if r.rid in self._chunks
        ) + sum(  # best-effort prompts being computed are served in admission order too
            r.num_tokens - r.num_computed
            for r in self.best_effort.running.values()
            if r.num_tokens - r.num_computed > 1
        )
        own = req.num_tokens if req.group is None else groups.prefill_tokens(req)
        return self.pace.bound(ahead, own, later=0 if req.group is None else 1)

    def _try(self, req: Request) -> tuple[Hit | None, int | None]:
        """What the ledger is asked for `req`: its cached hit (None: it cannot start this step,
        for lack of budget or rows) and its prefill bound if admitted now."""
        view = self.view
        if not view.can_start():
            return None, None
        chunks = None
        if self.follows:
            if self._rows(req) > self.running_cap:
                return None, None
            chunks = self._prefill_bound(req)
            if req.peak_shape.prefill_chunks != chunks:
                req.peak_shape = replace(req.peak_shape, prefill_chunks=chunks)
        kv = view.kv
        chains = kv.peek(req)
        self._chains[req.rid] = chains
        hit = Hit(
            sum(len(c) for c in chains.values()),
            kv.strict_idle_pages(chains),
            kv.strict_sole_pages(chains),
        )
        return hit, chunks

    def _admitted(self, decision: Admitted) -> tuple[Request, int | None]:
        """The request an in-step admission starts, checked, with its prefill bound (None:
        the ledger follows no progress)."""
        req = self.view.waiting_by_rid.get(decision.rid)
        if req is None:
            raise InvariantBreach(f"request {decision.rid!r} was admitted but is not waiting")
        if decision.reserved != req.count.total:
            raise InvariantBreach(
                f"request {req.rid!r} was admitted for {decision.reserved} pages but the "
                f"engine counts {req.count.total}"
            )
        return req, self._prefill_bound(req) if self.follows else None

    def admit(self) -> Iterator[Action]:
        self._sync_supply()
        backend = self.backend
        later = backend.later
        if later is not None:
            yield from self._apply(later, later.collect())
            if later.settled():
                yield from self._pin.grow(
                    self.view, backend, later, self.best_effort, sole_costs=self.follows
                )
                self._sync_supply()
            rows = self._rows(None) - 1
            yield from self._apply(later, later.poll(max(0, self.running_cap - rows)))
            yield from self.best_effort.admit()
            return
        strict = self.best_effort.strict
        passed = ask_in_order(backend, lambda: strict, _rid, self._try, self.backfill_depth)
        for _, decision in passed:
            req, chunks = self._admitted(decision)
            chains = self._chains.pop(decision.rid)
            yield from self.best_effort.make_room(req, chains)
            self.best_effort.leave_queue(req)
            yield Start(req, chains)
            if chunks is not None:
                self._chunks[req.rid] = chunks
            if decision.hit.pages > decision.hit.idle_pages:
                self._sharing_changed = True
        self._chains.clear()
        yield from self.best_effort.admit()

    # ---- decisions that come later (a sidecar the step does not wait on) --------------------

    def _apply(self, later: LateAnswers, decisions: list[Decision]) -> Iterator[Action]:
        view = self.view
        for item in self._reader.admissions(view, self.backend, decisions, self._pin.forget):
            self.best_effort.leave_queue(item.req)
            if isinstance(item, Reject):
                yield item
                continue
            req = item.req
            yield from self.best_effort.make_rows(partial(self._rows_over, req))
            if len(view.running) >= self.running_cap:
                raise InvariantBreach(
                    f"request {req.rid!r} was admitted beyond the room the engine reported: "
                    f"{len(view.running)} run, the cap is {self.running_cap}"
                )
            yield from self.best_effort.make_room(req, item.lease)
            if self.follows:
                chunks = self._prefill_bound(req)
                later.start(req.rid, chunks)  # before the prompt's pages are taken
                self._chunks[req.rid] = chunks
            yield Start(req, item.lease)
            if item.decision.hit.pages:
                self._sharing_changed = True

    # ---- pages ---------------------------------------------------------------------------------

    def on_take(self, req: Request, pages: int) -> None:
        if req.rid not in self.best_effort.running:
            self.backend.take(req.rid, pages)

    def on_release(self, req: Request) -> None:
        self._chunks.pop(req.rid, None)
        self._resumed_at.pop(req.rid, None)
        if not self.best_effort.released(req):
            self.backend.release(req.rid)
        if any(r.hit_pages for r in self.view.running.values()):
            self._sharing_changed = True

    def on_give_back(self, req: Request, held: int, reserved: int) -> None:
        # What still runs of it grows as its live sequences do (their own pages only).
        shape = groups.live_shape(self.view.model, req) if self.follows else None
        self.backend.give_back(req.rid, held, reserved, shape)

    def end_step(self) -> None:
        """Report every running request's progress, then close the step in the ledger."""
        if not self.follows:  # the banker counts worst cases until release: nothing to report
            self._sync_supply()
            self.best_effort.end_step()
            return
        view, backend = self.view, self.backend
        recount, self._sharing_changed = self._sharing_changed, False
        for req in self.best_effort.strict_running():
            chunks = self._chunks.get(req.rid)
            if chunks is not None:  # in prefill: the bound counts down, progress or not
                if groups.prefilled(req):
                    del self._chunks[req.rid]
                    chunks = 0
                elif chunks <= 1:
                    continue  # past its bound: stalled
                else:
                    chunks -= 1
                    self._chunks[req.rid] = chunks
            elif not view.scheduled(req.rid):
                continue  # a decode row was skipped: stalled
            if req.group is not None:  # its sequences as one (exact exclusive pages each step)
                produced, tokens, own = groups.progress(req, view.kv)
                backend.advance(req.rid, produced, tokens, chunks or 0, own)
                continue
            # Tokens whose KV is written (the last sampled token is not yet): the timeline's
            # next step writes the one after them.
            written = {
                lay.name: lay.tokens_at(req.num_computed, len(req.prompt)) for lay in req.layout
            }
            exclusive = view.kv.exclusive_pages(req) if recount else None
            produced = len(req.output) - self._resumed_at.get(req.rid, 0)
            backend.advance(req.rid, produced, written, chunks or 0, exclusive)
        self._sync_supply()
        ended = backend.end_step()
        if ended.stalled:
            log.warning(
                "%s: %d running request(s) made no progress this step; admitting "
                "conservatively until all advance",
                self.name,
                len(ended.stalled),
            )
        self.stalled_steps = ended.stalled_steps
        self.best_effort.end_step()

    def _rows(self, req: Request | None) -> int:
        """Decode rows once `req` (None: a lone request) runs beside the running requests (a
        group has one a sequence): the running cap counts rows, which is what leaves prefill
        its guaranteed rate."""
        running = sum(
            1 if r.group is None else len(r.group.live()) for r in self.view.running.values()
        )
        return running + (1 if req is None or req.group is None else len(req.group.live()))

    def _rows_over(self, req: Request) -> int:
        return self._rows(req) - self.running_cap

    def _sync_supply(self) -> None:
        # Free, and evictable with the reclaimable pages (engine/kv/view.py); a no-op when the
        # figures are unchanged. The best-effort figures are for pickers (sidecar/routing.py).
        kv = self.view.kv
        self.backend.set_supply(*kv.ledger_supply(), self.best_effort.figures(kv.reclaimable))

    def on_cancel(self, req: Request) -> None:
        self._parts.cancel(self.backend, self.best_effort, req)

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        return self._parts.shortage(
            self.name, self.view, self.backend, self.best_effort, req, spared
        )

    def check_integrity(self) -> None:
        self._parts.check(self.view, self.backend)


def _rid(req: Request) -> str:
    return req.rid
