"""Best-effort requests beside strict ones, for kvbank's ledger policies (`LedgerPolicy` in
engine/admission/ledger_policy.py holds one
`BestEffort`).

Strict requests go through the ledger as they always did; best-effort requests are never in
its books. What the ledger is told keeps strict requests safe whatever best-effort ones do:

- The supply it is told counts pages only best-effort requests hold as reclaimable
  (`CacheView.ledger_supply`): preempting those requests hands them back at once. A best-effort
  request taking a free or idle page moves it into the reclaimable part, so best-effort traffic
  never changes that supply; a strict hit counts pages no strict request holds as idle
  (`CacheView.strict_idle_pages`), since leasing one takes it off the reclaimable part.
- Before a strict request starts, and whenever one cannot grow, best-effort requests are
  preempted until the pages are there (`make_room`, `shortage`). A strict request never waits
  on a page, and is never preempted.

A best-effort request is admitted, in arrival order after the strict pass, when its prompt's
uncached pages fit the pool now (never taking idle pages the waiting strict head will reuse) and
its prompt plus an estimate of its output (engine/admission/estimate.py) fits what the strict
reservations leave while it runs: free and evictable pages, less what running strict requests
may take in the steps it is expected to run (`strict_growth`: a token a step each, never past
its reservation; not the whole of what they reserved, which they reach only later) and what
running best-effort requests are expected to grow by. Those figures are the engine's own, so
an embedded ledger, a sidecar's and every tensor-parallel rank give the same answer; the test is
for throughput only (safety rests on the supply the ledger is told). A victim's pages become
cache, its output's too (tail first: eviction takes only what the shortage needs), and it is
requeued under its arrival time. One preempted
`ClassPolicy.max_preemptions` times is promoted: submitted to the ledger (with a shape re-made
from where it is, `resumed_shape`: the one made at ingest would start its curve below the output
it already has) and admitted by the strict test for the rest of its life, so every request
finishes.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator

from kvbank.capacity import RequestShape, count_pages
from kvbank.engine import sequences as groups
from kvbank.engine.admission.actions import Action, Preempt, Start
from kvbank.engine.admission.estimate import DecayingRatio, LearnedLengths
from kvbank.engine.admission.view import AdmissionView
from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request
from kvbank.ledger import InvariantBreach, PeakShape, peak_shape
from kvbank.ledger.client import BestEffortFigures
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim

# Reloading a page from host costs about a tenth of recomputing its tokens (a page copy against
# a page of prefill); the cost-aware victim rule weighs the two by it.
RELOAD_COST = 0.1
CLASS = ServiceClass.BEST_EFFORT.value
# The learned estimate admits on a low quantile of the lengths seen above what a request has
# written: a preempted request keeps its pages as cache (and on host), so running more at once
# and preempting now and then beats reserving for the long tail (docs/benchmarks.md measures
# it against the decaying ratio and higher quantiles).
ADMIT_QUANTILE = 0.01


def make_estimator(estimate: Estimate) -> DecayingRatio | LearnedLengths:
    if estimate is Estimate.RATIO:
        return DecayingRatio()
    return LearnedLengths(quantile=ADMIT_QUANTILE)


class BestEffort:
    def __init__(
        self,
        classes: ClassPolicy,
        view: AdmissionView,
        running_cap: int,
    ) -> None:
        self.classes = classes
        self.view = view
        self.running_cap = running_cap
        self.estimator = make_estimator(classes.estimate)
        # Until the learned estimate has lengths to go by, the decaying ratio answers.
        self.warmup = DecayingRatio()
        self.waiting: list[Request] = []  # best-effort, by arrival
        # What each waiting best-effort request needs to start: its prompt's pages less the
        # cached prefix it had when it queued (the figure pickers route by, `backlog_pages`).
        self._start_pages: dict[str, int] = {}
        self.backlog_pages = 0
        self._arrived: list[str] = []  # best-effort requests queued since `figures`
        self.strict: deque[Request] = deque()  # strict, in the ledger's order
        self.running: dict[str, Request] = {}  # best-effort, in admission order
        self.victims: set[str] = set()  # decided preemptions not yet carried out
        self.preempted = 0
        self.promoted = 0

    def strict_running(self) -> Iterator[Request]:
        """The running requests the ledger holds (strict, promoted ones included): a
        best-effort one is no request of the ledger's, and an event naming it is refused."""
        running = self.running
        return (r for r in self.view.running.values() if r.rid not in running)

    # ---- queues --------------------------------------------------------------------------------

    def arrive(self, req: Request) -> bool:
        """Queue a request; True when it is best-effort (not the ledger's)."""
        if req.best_effort:
            self._requeue_waiting(req)
            self._arrived.append(req.rid)
            return True
        self.strict.append(req)
        return False

    def _requeue_waiting(self, req: Request) -> None:
        keys = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.arrival), req)
        chains = self.view.kv.peek(req)
        pages = max(0, req.pages_at(req.num_tokens) - sum(len(c) for c in chains.values()))
        self._start_pages[req.rid] = pages
        self.backlog_pages += pages

    def _left_waiting(self, req: Request) -> None:
        self.backlog_pages -= self._start_pages.pop(req.rid, 0)

    def leave_queue(self, req: Request) -> None:
        """A waiting request started, was rejected or cancelled."""
        queue: list[Request] | deque[Request] = self.waiting if req.best_effort else self.strict
        if req.best_effort:
            self._left_waiting(req)
        if queue and queue[0] is req:
            queue.popleft() if isinstance(queue, deque) else queue.pop(0)
        elif req in queue:
            queue.remove(req)

    def figures(self, held: int) -> BestEffortFigures:
        """What pickers route best-effort requests by, with `held` the pages only best-effort
        requests hold; the arrivals since the last call."""
        arrived, self._arrived = tuple(self._arrived), []
        return BestEffortFigures(held, self.backlog_pages, arrived)

    def head(self) -> Request | None:
        """The waiting strict head: eviction spares its cached hit."""
        return self.strict[0] if self.strict else None

    def requeue(self, req: Request) -> bool:
        """A preempted request waits again; True when it was promoted to strict (the caller
        submits it to the ledger)."""
        self.victims.discard(req.rid)
        self.preempted += 1
        if req.preemptions >= self.classes.max_preemptions:
            req.best_effort = False  # it holds and pins nothing now
            self.promoted += 1
            self.strict.append(req)
            return True
        self._requeue_waiting(req)
        return False

    def resumed_shape(self, req: Request) -> PeakShape | None:
        """A promoted request's shape from where it is: its output so far counted as prompt,
        what is left of its budget as output. None when that does not count the same worst
        case (a label whose output is not one position per token): it is then submitted
        without a shape, at its worst case until it finishes."""
        left = req.max_output - len(req.output)
        if left < 1 or not self.view.kv.caches_output(req):
            return None
        shape = RequestShape(req.num_tokens, left, req.shape.extra_tokens, req.shape.labels)
        count = count_pages(self.view.model, shape)
        if count.total != req.count.total or count.output_tokens != left:
            return None
        return peak_shape(self.view.model, shape, count=count)

    def released(self, req: Request) -> bool:
        """A running request left; True when it was best-effort (not the ledger's)."""
        if self.running.pop(req.rid, None) is None:
            return False
        if req.rid not in self.victims:
            self.estimator.observe(CLASS, len(req.output))
        return True

    def end_step(self) -> None:
        self.estimator.end_step()
        self.warmup.end_step()

    # ---- admission -----------------------------------------------------------------------------

    def admit(self) -> Iterator[Action]:
        """Start best-effort requests in arrival order while they fit."""
        view = self.view
        while self.waiting and view.can_start() and len(view.running) < self.running_cap:
            req = self.waiting[0]
            chains = view.kv.peek(req)
            if not self._fits(req, chains):
                return
            self._left_waiting(self.waiting.pop(0))
            self.running[req.rid] = req
            yield Start(req, chains)

    def _fits(self, req: Request, chains: Chains) -> bool:
        kv = self.view.kv
        hit = sum(len(c) for c in chains.values())
        idle = kv.idle_pages(chains)
        now = req.pages_at(req.num_tokens) - hit + idle
        if now > kv.supply - self._head_idle():
            return False
        growth = sum(max(0, self.expected_pages(r) - r.held) for r in self.running.values())
        strict = self.strict_growth(self.expected_steps(req))
        left = kv.free + kv.evictable - strict - growth
        return self.expected_pages(req) - hit + idle <= left

    def expected_steps(self, req: Request) -> int:
        """Steps `req` is expected to run for: one a token of the output it is expected to
        write, the first sampled in its prefill's last chunk, and its prefill's other chunks
        (no hit counted)."""
        chunks = -(-groups.prefill_tokens(req) // self.view.max_batch_tokens)
        return max(0, chunks - 1) + max(1, self.expected_output(req) - len(req.output))

    def strict_growth(self, steps: int) -> int:
        """Pages the running strict requests may take while a best-effort request runs for
        `steps` steps: a token a step each (speculative positions ahead), never past its
        reservation. Steps count tokens: a row that accepts drafted tokens writes more in a
        step, and so does the best-effort one. A best-effort request that finishes as expected
        gives its pages back before strict requests reach the rest of what they reserved; one
        that runs longer is preempted when they do, so safety never rests on this."""
        ahead = steps + self.view.model.speculative_tokens
        taken = 0
        for r in self.strict_running():
            reach = groups.pages_at(r, lambda seq: seq.num_tokens + ahead)
            taken += max(0, min(r.worst, reach) - groups.held(r))
        return taken

    def _head_idle(self) -> int:
        head = self.head()
        return self.view.kv.idle_pages(self.view.kv.peek(head)) if head is not None else 0

    def expected_output(self, req: Request) -> int:
        """Output tokens the request is expected to write in all (at least what it has)."""
        estimator: DecayingRatio | LearnedLengths = self.estimator
        if (
            isinstance(estimator, LearnedLengths)
            and estimator.samples(CLASS) < estimator.min_samples
        ):
            estimator = self.warmup
        return estimator.expected_output(CLASS, len(req.output), req.max_output)

    def expected_pages(self, req: Request) -> int:
        """Pages the request is expected to reach: its prompt and the estimate of its output,
        with one step's lookahead."""
        positions = len(req.prompt) + self.expected_output(req) + self.view.model.speculative_tokens
        return min(req.worst, req.pages_at(positions))

    # ---- shortage ------------------------------------------------------------------------------

    def make_room(self, req: Request, chains: Chains) -> Iterator[Action]:
        """Before strict `req` starts with `chains` leased: preempt best-effort requests until
        the pages its prompt takes are there."""
        kv = self.view.kv
        hit = sum(len(c) for c in chains.values())
        while True:
            # A group's start takes every sequence's pages (its shared prompt pages once).
            short = groups.start_pages(req) - hit + kv.idle_pages(chains) - kv.supply
            if short <= 0:
                return
            victim = self.victim(short)
            if victim is None:  # the ledger's promise says this cannot happen
                raise InvariantBreach(
                    f"strict request {req.rid!r} was admitted but is {short} pages short of its "
                    f"prompt with no best-effort request left to preempt (supply {kv.supply})"
                )
            yield self._preempt(victim)

    def make_rows(self, over: Callable[[], int]) -> Iterator[Action]:
        """Before a strict request the ledger admitted starts: preempt best-effort requests
        while the running set, with it, is `over()` rows past the cap. A sidecar the step never
        waits on counted its room when it was asked; best-effort requests that started since
        hold rows the ledger's admissions have first claim on. None left: the caller checks."""
        while over() > 0:
            victim = self.victim(0)
            if victim is None:
                return
            yield self._preempt(victim)

    def shortage(self, req: Request) -> Preempt | None:
        """`req` cannot grow: preempt a best-effort request (possibly `req` itself when it is
        one); None when none runs."""
        victim = self.victim(1)
        return None if victim is None else self._preempt(victim)

    def _preempt(self, victim: Request) -> Preempt:
        self.victims.add(victim.rid)
        self.estimator.on_preemption()
        self.warmup.on_preemption()
        return Preempt(victim, cache=True)

    def victim(self, short: int) -> Request | None:
        """The best-effort request to preempt for a shortage of `short` pages, by the pool's
        rule (`Victim`) among those this preemption would not promote, when there are any: a
        promoted request reserves its remaining worst case, which the others then run without."""
        running = [r for r in self.running.values() if r.rid not in self.victims]
        if not running:
            return None
        last = self.classes.max_preemptions - 1
        running = [r for r in running if r.preemptions < last] or running
        if self.classes.victim is Victim.NEWEST:
            return max(running, key=lambda r: r.arrival)
        return min(running, key=lambda r: (self.rebuild_cost(r, short), -r.arrival))

    def rebuild_cost(self, req: Request, short: int) -> float:
        """What readmitting `req` would cost, in positions computed, if it were preempted now
        for a shortage of `short` pages: its full pages stay cached (tail first, `short` of
        them evicted: to host when there is a host tier, reloaded at `RELOAD_COST` a
        position, else recomputed), the rest is computed again."""
        kv = self.view.kv
        size = kv.page_size
        lanes = max(1, len(req.layout))
        cached = req.num_computed // size if kv.caches_output(req) else req.indexed
        lost = max(0, req.num_computed - cached * size)
        evicted = min(cached, -(-short // lanes))
        per_page = size * RELOAD_COST if kv.host_pages else size
        return lost + evicted * per_page
