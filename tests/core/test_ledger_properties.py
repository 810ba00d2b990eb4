"""Property test: random arrivals, admissions, growth, finishes and evictions against a small
model of a paged pool with shared prefixes never break the safe state, never let a running
request find the pool empty, never admit out of FIFO order, and always drain."""

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvbank.ledger import Hit, Ledger, Refused

GROUPS = 3


@dataclass
class Running:
    group: int
    reserved: int
    leased: int  # cached prefix pages leased at admission
    private: int = 0  # pages it allocated itself


class PoolModel(RuleBasedStateMachine):
    """Pages are free, cached for a prefix group (evictable while no running request leases the
    group), or held privately by a running request."""

    @initialize(
        usable=st.integers(4, 40),
        prefix=st.lists(st.integers(0, 6), min_size=GROUPS, max_size=GROUPS),
    )
    def setup(self, usable: int, prefix: list[int]) -> None:
        self.usable = usable
        self.prefix_len = prefix
        self.cached = [0] * GROUPS
        self.holders = [0] * GROUPS
        self.free = usable
        self.ledger = Ledger(usable + 1, debug=True)
        self.running: dict[str, Running] = {}
        self.group_of: dict[str, int] = {}
        self.submitted: list[str] = []
        self.admitted: list[str] = []
        self.counter = 0

    # ---- the pool model ------------------------------------------------------------------------

    def evictable(self) -> int:
        return sum(c for c, h in zip(self.cached, self.holders, strict=True) if h == 0)

    def peek(self, rid: str) -> Hit:
        group = self.group_of[rid]
        pages = self.cached[group]
        return Hit(pages, pages if self.holders[group] == 0 else 0)

    def sync_supply(self) -> None:
        self.ledger.set_supply(self.free, self.evictable())

    # ---- rules ---------------------------------------------------------------------------------

    @rule(extra=st.integers(0, 45), group=st.integers(0, GROUPS - 1))
    def arrive(self, extra: int, group: int) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        worst = self.prefix_len[group] + max(1, extra)
        self.group_of[rid] = group
        decision = self.ledger.submit(rid, worst)
        if decision is None:
            assert worst <= self.usable
            self.submitted.append(rid)
        else:
            assert isinstance(decision, Refused) and worst > self.usable

    @rule()
    def admit(self) -> None:
        while (rid := self.ledger.head) is not None:
            hit = self.peek(rid)
            decision = self.ledger.try_admit(rid, hit)
            if decision is None:
                break
            group = self.group_of[rid]
            if hit.pages:
                self.holders[group] += 1
            self.running[rid] = Running(group, decision.reserved, hit.pages)
            self.admitted.append(rid)

    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        growing = [rid for rid, r in self.running.items() if r.leased + r.private < r.reserved]
        if not growing:
            return
        rid = data.draw(st.sampled_from(sorted(growing)))
        req = self.running[rid]
        for _ in range(data.draw(st.integers(1, req.reserved - req.leased - req.private))):
            self.grow_one(rid)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if not self.running:
            return
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.ledger.release(rid)
        group = req.group
        if req.leased:
            self.holders[group] -= 1
        # its own prefix pages extend the cached prefix; the rest are freed
        cacheable = min(self.prefix_len[group], req.leased + req.private)
        kept = max(0, cacheable - self.cached[group]) if self.cached[group] >= req.leased else 0
        kept = min(kept, req.private)
        self.cached[group] += kept
        self.free += req.private - kept
        self.sync_supply()

    @rule()
    def evict(self) -> None:
        idle = [g for g in range(GROUPS) if self.holders[g] == 0 and self.cached[g]]
        if idle:
            self.cached[idle[-1]] -= 1
            self.free += 1
            self.sync_supply()

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def safe(self) -> None:
        if not hasattr(self, "ledger"):
            return
        self.ledger.check_integrity()
        assert self.ledger.supply == self.free + self.evictable()
        held = sum(r.private for r in self.running.values())
        assert self.free + sum(self.cached) + held == self.usable
        assert self.admitted == self.submitted[: len(self.admitted)], "admitted out of FIFO order"

    def teardown(self) -> None:
        if not hasattr(self, "ledger"):
            return
        # Progress: once running requests finish, every queued request is admitted in turn.
        for _ in range(len(self.submitted) + 1):
            for rid in list(self.running):
                req = self.running[rid]
                while req.leased + req.private < req.reserved:
                    self.grow_one(rid)
                self.finish_one(rid)
            self.admit()
        assert self.ledger.waiting_count() == 0, "the queue did not drain"

    def grow_one(self, rid: str) -> None:
        # The promise: an admitted request that still may grow always finds a page.
        assert self.free + self.evictable() >= 1, "an admitted request ran out of pages"
        if self.free:
            self.free -= 1
        else:
            idle = [g for g in range(GROUPS) if self.holders[g] == 0 and self.cached[g]]
            self.cached[idle[0]] -= 1  # evict the tail (a leaf) of an idle prefix
        self.running[rid].private += 1
        self.ledger.take(rid, 1)

    def finish_one(self, rid: str) -> None:
        req = self.running.pop(rid)
        self.ledger.release(rid)
        if req.leased:
            self.holders[req.group] -= 1
        self.free += req.private
        self.sync_supply()


PoolModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestLedgerProperties = PoolModel.TestCase
