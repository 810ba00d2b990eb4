"""A small step-driven engine around a policy ledger, for the peak-fit tests.

It keeps the scheduler's side of the bargain (every running request advances every step: a
prefill row by one chunk, a decode row by 1 to 1 + spec tokens) and models a paged pool with
shared prefixes as the engine's does: per group a cached chain of pages; a running request
leases its first pages; eviction takes idle pages from the tail (leaves only). Each decode step
allocates exactly the bound at k = 0 (pages for tokens + 1 + spec, capped at the worst case), so
a bound that is one token short fails here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ledger_pass import admit_all

from kvbank.capacity import CapacityModel, RequestShape, label_growth, pages_for
from kvbank.ledger import Hit, Ledger, PeakPolicy, peak_shape


class PageDenied(AssertionError):
    """An admitted request asked for a page and the pool had none: the promise broke."""


@dataclass
class Spec:
    """One request: prompt, max_tokens (None: the model's limit), the output it will actually
    produce before its stop token, its prefix group (or None) and arrival step (open loop)."""

    prompt: int
    max_tokens: int | None
    output: int
    group: int | None = None
    arrival: int = 0


@dataclass
class Live:
    rid: str
    spec: Spec
    group: int | None
    budget: int
    base: dict[str, int]
    rate: dict[str, int]
    worst: dict[str, int]
    chunks_left: int
    prompt_left: int
    leased: int = 0
    private: int = 0
    produced: int = 0
    started: bool = False

    @property
    def held(self) -> int:
        return self.leased + self.private


@dataclass
class Driver:
    model: CapacityModel
    pages: int  # pool pages, sink included
    chunk: int  # prefill tokens per row per step
    prefix_tokens: list[int]  # per group, the shared prefix length
    peak: bool = True
    backfill: bool = False
    report_exclusive: bool = True
    seed: int = 0
    # Fail when a head starts after the step backfill promised it. Off where the pool does not
    # report sole pages: a known late start, not a breach (test_peak_properties' xfail).
    check_start_promises: bool = True
    step: int = 0
    free: int = 0
    chains: list[int] = field(default_factory=list)  # cached pages per group
    live: dict[str, Live] = field(default_factory=dict)
    promised: dict[str, int] = field(default_factory=dict)  # rid -> latest allowed start step
    started_at: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    waiting: dict[str, Live] = field(default_factory=dict)

    def __post_init__(self) -> None:
        policy = PeakPolicy(self.model.page_size, self.model.speculative_tokens, self.peak)
        if self.backfill:
            policy = PeakPolicy(
                self.model.page_size, self.model.speculative_tokens, self.peak, True, 4
            )
        self.ledger = Ledger(self.pages, debug=True, policy=policy)
        self.free = self.ledger.usable_pages
        self.chains = [0] * len(self.prefix_tokens)
        self.rng = random.Random(self.seed)
        self.counter = 0

    # ---- the pool ------------------------------------------------------------------------------

    def lease_depth(self, group: int) -> int:
        return max((r.leased for r in self.live.values() if r.group == group), default=0)

    def evictable(self) -> int:
        return sum(c - self.lease_depth(g) for g, c in enumerate(self.chains))

    def prefix_pages(self, live: Live) -> int:
        if live.group is None:
            return 0
        shared = min(self.prefix_tokens[live.group], live.spec.prompt)
        return shared // self.model.page_size

    def peek(self, rid: str) -> Hit:
        self.start_admitted()  # a pass may admit several: the next peek sees their leases
        live = self.waiting[rid]
        if live.group is None:
            return Hit()
        group = live.group
        pages = min(self.chains[group], self.prefix_pages(live))
        leases = [r.leased for r in self.live.values() if r.group == group]
        # page p is held by every running request of the group that leased past it
        sole = sum(1 for p in range(pages) if sum(1 for depth in leases if depth > p) == 1)
        idle = max(0, pages - self.lease_depth(group))
        return Hit(pages, idle, sole if self.report_exclusive else None)

    def allocate(self, live: Live, pages: int) -> None:
        for _ in range(pages):
            if self.free:
                self.free -= 1
            else:
                idle = [g for g, c in enumerate(self.chains) if c > self.lease_depth(g)]
                if not idle:
                    raise PageDenied(
                        f"step {self.step}: request {live.rid} holds {live.held} pages and "
                        f"needs {pages} more; the pool has none (ledger {self.ledger.snapshot()})"
                    )
                self.chains[idle[-1]] -= 1
            live.private += 1
        self.ledger.take(live.rid, pages)

    def exclusive(self, live: Live) -> int:
        if live.group is None:
            return live.held
        others = max(
            (r.leased for r in self.live.values() if r.group == live.group and r is not live),
            default=0,
        )
        return live.private + max(0, live.leased - others)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, spec: Spec) -> str | None:
        rid = f"r{self.counter}"
        self.counter += 1
        shape = RequestShape(spec.prompt, spec.max_tokens)
        growth, count = label_growth(self.model, shape)
        chunks = -(-spec.prompt // self.chunk)
        live = Live(
            rid,
            spec,
            spec.group if len(growth) == 1 else None,
            count.output_tokens,
            {k: g.base for k, g in growth.items()},
            {k: g.per_output for k, g in growth.items()},
            {k: g.worst for k, g in growth.items()},
            chunks,
            spec.prompt,
        )
        live.spec.output = min(spec.output, count.output_tokens)
        pshape = peak_shape(self.model, shape, chunks)
        if self.ledger.submit(rid, count.total, shape=pshape) is not None:
            return None
        self.waiting[rid] = live
        return rid

    def pages_at(self, live: Live, produced: int) -> int:
        """Pages the request holds with `produced` output tokens (capped at its worst case)."""
        return sum(
            pages_for(
                min(live.worst[k], live.base[k] + live.rate[k] * produced), self.model.page_size
            )
            for k in live.base
        )

    def start_admitted(self) -> None:
        for rid in [rid for rid in self.waiting if not self.ledger.is_waiting(rid)]:
            live = self.waiting.pop(rid)
            live.leased = self.ledger.reservation(rid).held
            self.live[rid] = live
            self.started_at[rid] = self.step
            due = self.promised.get(rid)
            assert not self.check_start_promises or due is None or self.step <= due, (
                f"{rid} started at step {self.step}, later than the promised {due}"
            )

    # ---- one step ------------------------------------------------------------------------------

    def run_step(self) -> list[str]:
        """Admit, run one step, settle. Returns the requests that finished."""
        admit_all(self.ledger, self.peek)
        self.start_admitted()
        if self.ledger.promised is not None:
            head, start = self.ledger.promised
            self.promised[head] = min(self.promised.get(head, 1 << 60), self.step + start)
        spec = self.model.speculative_tokens
        done = []
        for live in list(self.live.values()):
            if live.chunks_left:
                if not live.started:  # the first chunk takes the whole prompt
                    live.started = True
                    self.allocate(live, max(0, self.pages_at(live, 0) - live.held))
                # A chunk is at least the guaranteed budget; a prefill may end early.
                chunk = self.rng.choice([self.chunk, self.chunk, live.prompt_left])
                live.prompt_left = max(0, live.prompt_left - chunk)
                live.chunks_left = 0 if not live.prompt_left else live.chunks_left - 1
            else:
                need = self.pages_at(live, live.produced + 1 + spec)
                self.allocate(live, max(0, need - live.held))
                live.produced = min(live.spec.output, live.produced + self.rng.randint(1, 1 + spec))
            if not live.chunks_left and live.produced >= live.spec.output:
                done.append(live.rid)
            else:
                excl = self.exclusive(live) if self.report_exclusive else None
                self.ledger.advance(live.rid, live.produced, None, live.chunks_left, excl)
        for rid in done:
            self.finish(self.live[rid])
        self.ledger.set_supply(self.free, self.evictable())
        assert self.ledger.end_step() == []
        self.ledger.check_integrity()
        self.step += 1
        return done

    def finish(self, live: Live) -> None:
        del self.live[live.rid]
        self.ledger.release(live.rid)
        self.finished.append(live.rid)
        kept = 0
        if live.group is not None:
            g = live.group
            prefix = self.prefix_pages(live)
            if self.chains[g] >= live.leased and self.chains[g] < prefix:
                # its own prompt pages extend the cached chain; they stay in the index
                kept = min(prefix - self.chains[g], live.private)
                self.chains[g] += kept
        self.free += live.private - kept
