"""kvbank's ledger over vLLM's scheduler: which waiting requests vLLM may start, and what the
ledger must be told as vLLM's blocks move.

vLLM's waiting queue holds only requests the ledger admitted; the others wait here, in the
ledger's order (arrival, or as `KVBANK_ORDER` sets it: kvbank.vllm.order). Each step, before
vLLM schedules:

1. The admission pass (`ask_in_order`, as kvbank's own engine runs it) asks the ledger about
   the head (and, with backfill, later requests) with each one's cached hit, read from vLLM's
   prefix cache without touching it (behind the head, only if a hit could help), and its
   prefill bound.
2. An admitted request's hit blocks are pinned (reference count raised) at once, so nothing
   vLLM allocates before it is scheduled can evict them, until vLLM holds them too. Idle blocks
   (only the cache held them) leave the free supply when pinned and are reported as taken by
   the request; the hit sent is the shared part only (`outstanding + reserved - shared <=
   supply` is the ledger's `outstanding + reserved - hit <= supply - idle`). With a sidecar the
   schedule never waits on, the head's hit is pinned before it is reported, until the decision
   arrives (kvbank.vllm.pins).
3. The request joins vLLM's waiting queue and vLLM schedules it as it always does.

After each schedule the blocks every admitted request holds are compared with what the ledger
knows and the difference is reported as taken; after each model step finishes, releases and
(under peak-fit) every request's progress come from vLLM's own request state. The supply is
vLLM's free block count: free and evictable cached blocks together, as vLLM allocates from both,
less what windows freed that the ledger still counts as their requests' (kvbank.vllm.groups).

Each of vLLM's KV cache groups is a label of the request's count (kvbank.vllm.layout); a hit, a
pin and what a request holds are its blocks in every group, null blocks left out.

Best-effort requests (kvbank.vllm.classes) are never in the ledger's books: blocks only they hold
are reclaimable supply, and they are preempted to make room for strict ones.

Under vLLM's async scheduling a step is scheduled while the model runs the previous one, and its
output is processed after the next schedule: what the ledger is told after a step's output (its
num_computed_tokens counts the next step's positions) covers every schedule before it, and its
step k from then is vLLM's k-th schedule. Output tokens and releases, and so finishes, come a
step late, as vLLM frees blocks (a request's curve depends only on what it wrote and may still
produce). A schedule that follows another with no output between (the first after the
engine was idle) admits nothing: the ledger has not heard what the previous one allocated.

The prefill bound of a peak-fit admission is kvbank's engine's (`PrefillPace`): decode rows go
before prefill chunks and the running set stays below the token budget, so a prompt admitted
behind `T` prefill tokens is computed within ceil(T / (budget - running cap)) + 1 steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from operator import attrgetter
from typing import Any

from kvbank.capacity import CapacityModel, PageCount, RequestShape, count_pages, refusal
from kvbank.ledger import Admitted, Hit, InvariantBreach, UnknownRequest, peak_shape
from kvbank.ledger.client import LateAnswers, LedgerClient, ask_in_order
from kvbank.ledger.policy import PrefillPace
from kvbank.vllm.classes import Classes, tier_refusal
from kvbank.vllm.entry import Entry
from kvbank.vllm.groups import Holding, Tables, flat, hit_credit, steady_groups, window_overlap
from kvbank.vllm.order import make_order
from kvbank.vllm.pins import HeadPins
from kvbank.vllm.settings import Settings

log = logging.getLogger(__name__)
_RID = attrgetter("request_id")


class Admission:
    """The ledger's side of `KvbankScheduler`; it holds the backend and the waiting requests,
    and reads vLLM's scheduler state (`sched`) without changing its logic."""

    def __init__(
        self,
        sched: Any,
        model: CapacityModel,
        backend: LedgerClient,
        policy: str,
        depth: int,
        settings: Settings | None = None,
    ) -> None:
        """`settings`: the class and order settings; all-strict, in arrival order when None."""
        settings = settings or Settings(policy)
        self.sched = sched
        self.model = model
        self.backend = backend
        self.policy = policy
        self.peak = policy != "banker"
        self.total_pages = sched.kv_cache_manager.block_pool.num_gpu_blocks
        self.pool = sched.kv_cache_manager.block_pool
        self.tables = Tables(sched.kv_cache_manager)
        self.groups = len(model.kv_slots)
        self.steady = steady_groups(model)
        self.counts: dict[str, PageCount] = {}  # each waiting request's count
        self.waiting: OrderedDict[str, Any] = OrderedDict()  # not yet admitted, FIFO
        self.admitted: dict[str, Entry] = {}  # admission order
        self.refused: list[tuple[str, str]] = []  # (rid, why), for the caller to finish
        self.preemptions = 0  # of admitted requests: must stay 0
        self.stalled_steps = 0
        self.pace = PrefillPace.of(sched.max_num_running_reqs, sched.max_num_scheduled_tokens)
        self.depth = depth
        self._peeked: dict[str, list[list[Any]]] = {}
        self._sharing_changed = False
        # A sidecar's later answers: the head's pins (kvbank.vllm.pins), the last one applied.
        self.head_pins = HeadPins(self.pool, self.tables, self.steady, self.peak)
        self._last_seq = -1
        # The ledger heard every schedule's progress (an output since the last): admit then.
        self._reported = True
        self.classes = Classes(sched, self.tables, settings)
        self.order = make_order(settings.order, settings.max_defer_steps)
        self._holders = self.classes.strict_holders()  # a block's strict holders, this pass
        self._ahead: int | None = None  # the admitted prompts' rest (`_chunks`), this pass

    # ---- arrivals ------------------------------------------------------------------------------

    def arrive(self, request: Any) -> bool:
        """Count a new request and queue it; False (a refusal noted) if the pool never can."""
        shape = RequestShape(request.num_prompt_tokens, request.max_tokens)
        count = count_pages(self.model, shape)
        why = refusal(self.model, shape, self.total_pages, count)
        message = why.message if why is not None else tier_refusal(request)
        if message is not None:
            self.refused.append((request.request_id, message))
            return False
        if self.classes.arrive(request):
            return True  # best-effort: never in the ledger's books
        self._submit(request, count, peak_shape(self.model, shape, count=count))
        return True

    def _submit(self, request: Any, count: PageCount, shape: Any) -> None:
        """Queue a strict request for the ledger; `shape` counts only under peak-fit."""
        rid = request.request_id
        self.waiting[rid] = request
        self.counts[rid] = count
        self.backend.submit(rid, count.total, shape=shape if self.peak else None)
        self.order.queued(rid, count.total, shape if self.peak else None)

    def cancel(self, rid: str) -> None:
        """A request left (aborted) wherever it was."""
        if self.classes.cancel(rid):
            return  # best-effort: vLLM frees what it holds
        if rid in self.head_pins:
            in_flight = (later := self.backend.later) is not None and not later.settled()
            self.head_pins.unpin(rid, in_flight=in_flight, holders=self.classes.strict_holders())
        self.counts.pop(rid, None)
        if self.waiting.pop(rid, None) is not None:
            with contextlib.suppress(UnknownRequest):
                self.backend.cancel(rid)
        elif rid in self.admitted:
            self._release(rid)

    # ---- admission, before vLLM schedules ------------------------------------------------------

    def admit(self) -> None:
        """The ledger's admission pass, not limited by this step's token budget: an admitted
        request waits in vLLM's queue behind earlier ones until vLLM gives it tokens, and its
        prefill bound counts every prompt token admitted before it, started or not."""
        # Strict decode rows first, then strict prefill chunks in admission order: every
        # running strict request advances every step, which peak-fit's promises rely on; then
        # best-effort rows, so vLLM's FCFS victim (`running[-1]`) is one while one runs.
        self.sched.running.sort(key=self.classes.running_order)
        self._ahead = None  # vLLM computed prompt tokens since
        for request, count, shape in self.classes.promotions(self.model):
            self._submit(request, count, shape)  # strict from now on
        if self._reported:  # async scheduling, a schedule right after another: see the docstring
            self._ledger_pass()
        self.classes.before_schedule()

    def _ledger_pass(self) -> None:
        self._sync_supply()
        if self.backend.later is not None:
            self._admit_later(self.backend.later)
            return
        if self.waiting:
            # Best-effort holdings do not change while the ledger is asked: counted once.
            self._holders = self.classes.strict_holders()
            self.order.reorder(self.waiting, self.admitted.values(), self.backend)
            done = ask_in_order(self.backend, lambda: [*self.waiting.values()], _RID, self._ask,
                                self.depth, self._bound)  # fmt: skip
            for _, admitted in done:
                self._started(admitted)
        self._peeked.clear()

    # ---- a sidecar the schedule never waits on --------------------------------------------------

    def _admit_later(self, later: LateAnswers) -> None:
        """Apply the decisions that arrived; while nothing is in flight (a decision on its way
        may have counted what a pin takes, or name a request the order moves) reorder the
        waiting requests and pin the head; send the next report without waiting for its answer."""
        self._apply(later, later.collect())
        if later.settled():
            # Every answer is known: a request that left was admitted (and released by `_apply`
            # ahead of the supply below) or never will be. A moved head's pins go.
            self.head_pins.settle()
            for rid in self.order.reorder(self.waiting, self.admitted.values(), self.backend):
                self.head_pins.unpin(rid, in_flight=False)
            self._pin_head(later)
            self._sync_supply()
        self._apply(later, later.poll(max(0, self.pace.running_cap - len(self.admitted))))

    def _pin_head(self, later: LateAnswers) -> None:
        """Pin more of the head's computed blocks within the ledger's headroom (`HeadPins.pin`)
        and tell the ledger the pins' cost, the pinned blocks as the head's hit (held, none idle)
        and (peak-fit, a pin that shares a block) the admitted requests' exclusive counts."""
        head = next(iter(self.waiting.values()), None)
        if head is None:
            return
        holders = self.classes.strict_holders()
        pinned = self.head_pins.pin(head, self.backend.headroom(), holders)
        if pinned is None:
            return
        recounted = self.admitted.items() if pinned.shared and self.peak else ()
        exclusive = {rid: entry.exclusive(self.tables, holders) for rid, entry in recounted}
        later.pin(head.request_id, pinned.blocks, pinned.cost, exclusive)

    def _apply(self, later: LateAnswers, decisions: list[Any]) -> None:
        if not decisions:
            return
        holders = self.classes.strict_holders()  # no best-effort holding changes in here
        for decision in sorted(decisions, key=lambda d: d.seq):
            if decision.seq <= self._last_seq:
                continue  # a resent decision: applied once
            self._last_seq = decision.seq
            rid = decision.rid
            if not isinstance(decision, Admitted):
                raise InvariantBreach(f"the sidecar refused {rid!r}: {decision}")
            request = self.waiting.pop(rid, None)
            count = self.counts.pop(rid, None)
            if request is None or count is None:  # it left while the decision was on its way
                self.head_pins.unpin(rid, False, holders)
                self.backend.release(rid)
                continue
            pins = self.head_pins.keep(rid, decision.hit.pages)
            chunks = self._chunks(request)
            if chunks is not None:
                later.start(rid, chunks)  # before vLLM takes the prompt's blocks
            holding = Holding.of(self.model, request, count, pins, holders)
            self._enter(request, Entry(request, holding, pins, chunks), decision)

    def _chunks(self, request: Any) -> int | None:
        """Its prefill bound if admitted now (peak-fit): the admitted prompts' rest, then its.
        The rest is summed once until a request is admitted, not for every candidate."""
        if not self.peak:
            return None
        if self._ahead is None:
            admitted = (e.request for e in self.admitted.values() if e.chunks is not None)
            self._ahead = sum(r.num_tokens - r.num_computed_tokens for r in admitted)
        return self.pace.bound(self._ahead, request.num_tokens)

    def _bound(self, request: Any) -> tuple[int, int | None]:
        """What `_ask` gives without the look-up: the most its hit can count (every full block
        of each steady group shared) and the prefill bound."""
        most = sum(self.steady) * (request.num_tokens // self.model.page_size)
        return most, self._chunks(request)

    def _ask(self, request: Any) -> tuple[Hit | None, int | None]:
        """The ledger's question for `request`: its shared cached hit (None: the running cap
        is reached) and its prefill bound if admitted now."""
        if len(self.admitted) >= self.pace.running_cap:
            return None, None
        hit = self.tables.hit(request)
        self._peeked[request.request_id] = hit
        credit, sole = hit_credit(hit, self.steady, self._holders)
        return Hit(credit, 0, sole), self._chunks(request)

    def _started(self, decision: Admitted) -> None:
        rid = decision.rid
        request = self.waiting.pop(rid, None)
        if request is None:
            raise InvariantBreach(f"request {rid!r} was admitted but is not waiting")
        pin = self._peeked.pop(rid, [[] for _ in range(self.groups)])
        taken = len(flat(pin)) - decision.hit.pages  # idle blocks and window copies
        chunks = self._chunks(request)
        self.pool.touch(flat(pin))
        holding = Holding.of(self.model, request, self.counts.pop(rid), pin, self._holders)
        if taken:
            self.backend.take(rid, taken)  # the pin took them off the supply
        self._enter(request, Entry(request, holding, pin, chunks), decision)

    def _enter(self, request: Any, entry: Entry, decision: Admitted) -> None:
        """An admitted request joins vLLM's waiting queue, as vLLM queues an arrival."""
        self.admitted[decision.rid] = entry
        self._ahead = None  # its prompt is now ahead of the next
        self._sharing_changed |= decision.hit.pages > 0
        self.sched._enqueue_waiting_request(request)

    # ---- after vLLM scheduled ------------------------------------------------------------------

    def scheduled(self, preempted: set[str]) -> None:
        """Drop the pins of requests vLLM now holds, and report what every admitted request
        took this step. `preempted`: the requests vLLM preempted in this schedule."""
        for rid in preempted & self.admitted.keys():
            self.preemptions += 1
            log.error("vLLM preempted %r, which kvbank admitted: a kvbank bug", rid)
        self.classes.taken_back(preempted)
        running = _running()
        holders = self.classes.strict_holders()
        for rid, entry in self.admitted.items():
            if entry.request.status != running:
                continue
            entry.unpin(self.pool)  # vLLM holds the hit now
            holding = entry.holding
            shared = holding.shared
            grown = holding.hold(rid, self.tables.held(rid), holders)
            if holding.shared > shared:
                # vLLM caches a prompt's full blocks as it allocates them, so a request
                # scheduled after another in one step can hit blocks the other just took, which
                # the other no longer returns alone: counted as taken, the ledger hears the
                # exact exclusive counts at this step's end.
                self._sharing_changed = True
            if grown:
                self.backend.take(rid, grown)
        self._sync_supply()
        self._reported = False

    # ---- after the model step ------------------------------------------------------------------

    def step_done(self, scheduled: dict[str, int]) -> None:
        """Release what finished; under peak-fit report every admitted request's progress and
        close the step in the ledger."""
        self._reported = True
        self.classes.step_done()
        finished = [rid for rid, e in self.admitted.items() if e.request.is_finished()]
        for rid in finished:
            self._release(rid)
        self._sync_supply()
        if not self.peak or not (scheduled or self.admitted):
            return  # banker; or an empty step (an idle engine's, see has_requests): no step
        holders = self.classes.strict_holders() if self._sharing_changed else None
        self._sharing_changed = False
        for rid, entry in self.admitted.items():
            if not entry.step_done(rid in scheduled, self.classes.prompt_end(entry.request)):
                continue  # stalled
            request = entry.request
            exclusive = None if holders is None else entry.exclusive(self.tables, holders)
            written = entry.holding.written(request.num_computed_tokens, request.num_prompt_tokens)
            produced = self.classes.produced(request)
            self.backend.advance(rid, produced, written, entry.chunks or 0, exclusive)
        ended = self.backend.end_step()
        if ended.stalled:
            log.warning(
                "%s: %d running request(s) made no progress this step; admitting "
                "conservatively until all advance", self.policy, len(ended.stalled),
            )  # fmt: skip
        self.stalled_steps = ended.stalled_steps

    def _release(self, rid: str) -> None:
        entry = self.admitted.pop(rid)
        self._ahead = None
        entry.unpin(self.pool)
        self.classes.cancel(rid)  # a promoted request's offsets
        self.backend.release(rid)
        if self.admitted and entry.holding.shared:  # its sharers may now hold those alone
            self._sharing_changed = True

    def _sync_supply(self) -> None:
        self.backend.set_supply(self._supply(), 0, self.classes.figures(self.backend.later))

    def _supply(self) -> int:
        """vLLM's free blocks and those only best-effort requests hold, less those windows
        freed that the ledger still counts as their requests' (kvbank.vllm.groups): they may
        take them again."""
        free = self.pool.get_num_free_blocks() + self.classes.reclaimable()
        free = max(0, free - self.head_pins.unpinned_in_flight)
        freed = sum(entry.holding.freed for entry in self.admitted.values())
        overlap = 0
        if not all(self.steady):
            held = [entry.holding.window_ids for entry in self.admitted.values()]
            held += self.head_pins.window_ids()
            overlap = window_overlap(held)
        if freed + overlap > free:
            raise InvariantBreach(
                f"admitted requests freed {freed} blocks they may take again and share "
                f"{overlap} window blocks but vLLM has only {free} free"
            )
        return free - freed - overlap

    def check_integrity(self) -> None:
        """The ledger safe and agreeing with vLLM's free blocks; no admitted request preempted
        or holding more in a group than its count."""
        if self.preemptions:
            raise InvariantBreach(
                f"vLLM preempted {self.preemptions} request(s) that kvbank admitted"
            )
        running = _running()
        holders = self.classes.strict_holders()
        for rid, entry in self.admitted.items():
            if entry.request.status == running and not entry.pin:
                entry.holding.recount(rid, self.tables.held(rid), holders)  # raises past it
        self.backend.check_integrity(self._supply(), 0)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.classes.waiting)


def _running() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING
