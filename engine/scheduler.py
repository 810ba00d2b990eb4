"""Continuous batching: which rows run this step, and what their results change.

A step's rows, in this order:
1. Decode rows of every running request (one token each). They are scheduled before admission
   and never skipped for it, so under the banker policy every running request advances at least
   one token every step: its reservation covers its growth, `grow` cannot fail, and admission
   only spends what is left of the token budget. Peak-fit admission relies on this; the one
   place it could break is `_decode_row`, which under banker raises rather than stall.
2. Prefill chunks of running requests mid-prompt, oldest admission first.
3. New admissions from the waiting head (the policy decides), each with a first chunk.
A prompt longer than what is left of the budget is chunked. Its first chunk's admission takes the
pages of the whole prompt, so later chunks take no more and a half-written prompt never waits on
pages (a prompt that took its pages chunk by chunk could wedge a full pool).

Admission runs one way: the policy reads the queues and the cache through a read-only
`AdmissionView` and yields decisions (engine/admission/actions.py); `carry_out` does each, and
the policy hears of the pages that moved through its `on_*` events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from types import MappingProxyType

from kvbank.capacity import CapacityModel
from kvbank.engine import group_rows as groups
from kvbank.engine.admission.actions import Action, Pin, Preempt, Reject, Start
from kvbank.engine.admission.policy import AdmissionPolicy
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.group_rows import GroupRows
from kvbank.engine.kv.cache import Chains, KVCache
from kvbank.engine.kv.pages import OutOfPages
from kvbank.engine.kv.victims import cache_output
from kvbank.engine.kv.view import CacheView
from kvbank.engine.request import FinishReason, Request, Status
from kvbank.engine.runner import RowInput, StepBatch, StepResult


@dataclass
class Row:
    req: Request
    start: int
    count: int
    sample: bool


@dataclass
class SchedulerStats:
    admitted: int = 0
    preemptions: int = 0
    stalled_rows: int = 0
    hit_tokens: int = 0  # positions skipped thanks to the prefix cache
    prefill_tokens: int = 0  # positions admissions had to cover (hit or computed)
    finished: int = 0
    rejected: int = 0


@dataclass
class Finished:
    req: Request
    reason: FinishReason


@dataclass
class Scheduler(GroupRows):
    model: CapacityModel
    kv: KVCache
    policy: AdmissionPolicy
    max_batch_tokens: int = 2048
    max_running: int = 256
    waiting: deque[Request] = field(default_factory=deque)
    waiting_by_rid: dict[str, Request] = field(default_factory=dict)
    running: dict[str, Request] = field(default_factory=dict)  # admission order
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    budget_left: int = 0
    rows: dict[str, Row] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)  # drained by the engine
    _admissions: int = 0

    def __post_init__(self) -> None:
        self.view = AdmissionView(
            model=self.model,
            kv=CacheView(self.kv),
            waiting=self.waiting,
            waiting_by_rid=MappingProxyType(self.waiting_by_rid),
            running=MappingProxyType(self.running),
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            can_start=self.can_start,
            scheduled=self._scheduled,
        )
        self.policy.bind(self.view)

    # ---- queue ---------------------------------------------------------------------------------

    def enqueue(self, req: Request, at_head: bool = False, by_arrival: bool = False) -> None:
        """Queue at the tail, at the head, or (`by_arrival`) ahead of every later arrival."""
        req.status = Status.WAITING
        if at_head:
            self.waiting.appendleft(req)
        elif by_arrival:
            at = next((i for i, r in enumerate(self.waiting) if r.arrival > req.arrival), None)
            if at is None:
                self.waiting.append(req)
            else:
                self.waiting.insert(at, req)
        else:
            self.waiting.append(req)
        self.waiting_by_rid[req.rid] = req

    def dequeue(self, req: Request) -> None:
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        del self.waiting_by_rid[req.rid]

    def can_start(self) -> bool:
        return self.budget_left > 0 and len(self.running) < self.max_running

    def _scheduled(self, rid: str) -> bool:
        if rid in self.rows:
            return True
        req = self.running.get(rid)
        return req is not None and req.group is not None and self._group_scheduled(req)

    def cancel(self, req: Request) -> None:
        """A waiting request leaves before admission (its client went away): its pins go."""
        self.dequeue(req)
        self.kv.unpin(req)
        self.policy.on_cancel(req)

    def carry_out(self, action: Action) -> None:
        """Do what the policy decided."""
        if isinstance(action, Start):
            self.start(action.req, action.lease)
        elif isinstance(action, Pin):
            self.kv.pin(action.req, action.max_idle, action.sole_costs)
        elif isinstance(action, Reject):
            self.kv.unpin(action.req)
            self.dequeue(action.req)
            self.finish(action.req, FinishReason.REJECTED)
        elif isinstance(action, Preempt):
            self.preempt(action.req, action.cache)

    def start(self, req: Request, chains: Chains) -> None:
        """Admit `req`: lease its cached prefix, take the pages of its whole prompt (or, resumed
        after preemption, of everything it had), and give it a first chunk if budget is left."""
        self.dequeue(req)
        leased = self.kv.lease(req, chains)
        grown = self.kv.grow_reloading(req, groups.start_positions(req), self._protected)
        if grown:
            self.policy.on_take(req, grown)
        req.status = Status.RUNNING
        req.admitted_at = self._admissions
        self._admissions += 1
        self.running[req.rid] = req
        self.stats.admitted += 1
        self.stats.hit_tokens += (leased // max(1, len(req.layout))) * self.kv.page_size
        self.stats.prefill_tokens += req.num_tokens
        if req.group is not None:
            self._start_group(req)  # the other sequences take their pages; first rows
        else:
            self._prefill_row(req)

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self, step: int) -> StepBatch:
        self.budget_left = self.max_batch_tokens
        self.rows = {}
        pending = []
        for req in list(self.running.values()):
            if req.rid not in self.running:
                continue  # preempted by an earlier row's shortage this step
            if req.group is not None:
                if not self._group_decode_rows(req):
                    pending.append(req)
            elif len(req.prompt) + len(req.output) - req.num_computed == 1:
                self._decode_row(req)
            else:
                pending.append(req)
        for req in pending:
            if req.rid in self.running and self.budget_left > 0:
                if req.group is not None:
                    self._group_prefill_rows(req)
                else:
                    self._prefill_row(req)
        for action in self.policy.admit():
            self.carry_out(action)
        rows = [self._row_input(row) for row in self.rows.values()]
        return StepBatch(step, rows, self.kv.take_moves())

    def _decode_row(self, req: Request) -> None:
        positions = len(req.prompt) + len(req.output) + self.model.speculative_tokens
        # A policy that preempts best-effort requests does so before it takes the waiting
        # head's cached pages; only when none is left are those pages evicted.
        spare = self.policy.spares_head
        while True:
            try:
                grown = self.kv.grow(req, positions, self._protected, spare)
            except OutOfPages:
                victim = self.policy.on_shortage(req.holder, spare)
                if victim is None:
                    if spare:
                        spare = False
                        continue
                    self.stats.stalled_rows += 1
                    return
                self.preempt(victim.req, victim.cache)
                if victim.req is req.holder:
                    return
                continue
            if grown:
                self.policy.on_take(req.holder, grown)
            break
        self.rows[req.rid] = Row(req, req.num_computed, 1, True)
        self.budget_left -= 1

    def _protected(self) -> Collection[int]:
        """Pages the waiting head will reuse: eviction takes them only after every other idle
        page (when the policy has not pinned them instead). Asked only when an eviction
        happens, so the common step pays nothing for it."""
        head = self.policy.head() if self.policy.protects_head else None
        if head is None:
            return frozenset()
        chains = self.kv.peek(head)
        return frozenset(page for chain in chains.values() for page in chain)

    def _prefill_row(self, req: Request) -> None:
        remaining = req.num_tokens - req.num_computed
        chunk = min(remaining, self.budget_left)
        if chunk <= 0:
            return
        self.rows[req.rid] = Row(req, req.num_computed, chunk, chunk == remaining)
        self.budget_left -= chunk

    def _row_input(self, row: Row) -> RowInput:
        req = row.req
        return RowInput(
            rid=req.rid,
            token_ids=req.tokens(row.start, row.start + row.count),
            start_pos=row.start,
            page_ids=req.pages.get(req.layout[0].name, ()),
            sample=row.sample,
            sampling=req.sampling,
        )

    # ---- leaving the running set ---------------------------------------------------------------

    def preempt(self, req: Request, cache: bool = False) -> None:
        """Recompute preemption: drop the request's pages (its indexed prompt pages stay cached)
        and requeue it at the head with its output so far; readmission recomputes the rest.
        With `cache`, every computed page stays cached, its output's too, and it is requeued
        under its arrival time; readmission leases or reloads what is still there."""
        if req.group is not None:
            self._preempt_group(req)
        row = self.rows.pop(req.rid, None)
        if row is not None:
            self.budget_left += row.count
        if cache:
            cache_output(self.kv, req)
        self._leave(req)
        req.num_computed = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.enqueue(req, at_head=not cache, by_arrival=cache)
        self.policy.on_requeue(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.group is not None:
            self._finish_in_group(req, reason)
            return
        if req.status is Status.RUNNING:
            self._leave(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.finished.append(Finished(req, reason))
        self.stats.finished += 1

    def _leave(self, req: Request) -> None:
        del self.running[req.rid]
        self.kv.release(req)
        self.policy.on_release(req)

    # ---- postprocess ---------------------------------------------------------------------------

    def postprocess(self, result: StepResult, eos_token_id: int) -> None:
        for rid, row in self.rows.items():
            req = row.req
            req.num_computed = row.start + row.count
            if req.index_open and req.indexed < len(req.prompt) // self.kv.page_size:
                self.kv.index_prompt(req)
            if not row.sample:
                continue
            if rid in result.failed:  # this request alone ends; the step's others run on
                self.finish(req, FinishReason.ERROR)
                continue
            token = result.tokens[rid]
            req.output.append(token)
            groups.sampled(req)
            if token == eos_token_id and not req.sampling.ignore_eos:
                self.finish(req, FinishReason.STOP)
            elif len(req.output) >= req.max_output:
                self.finish(req, FinishReason.LENGTH)
        self.policy.end_step()

    # ---- integrity -----------------------------------------------------------------------------

    def check_integrity(self, deep: bool = False) -> None:
        self.kv.check_integrity(deep)
        for req in self.running.values():
            self.kv.check_request(req, deep)
            if req.group is not None:
                groups.check(req)
        self.policy.check_integrity()
