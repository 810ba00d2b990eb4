"""Best-effort requests beside strict ones in vLLM's scheduler, as kvbank's engine runs them
(engine/admission/besteffort.py); `Admission` holds one `Classes`.

A request's class: its `service_tier` extra argument (`vllm_xargs: {"service_tier": "flex"}` in
an OpenAI request's extra_body; the tiers of kvbank's own server, kvbank.service_class.TIERS),
then, under `vllm serve --scheduling-policy priority`, its priority (at or above
KVBANK_BEST_EFFORT_PRIORITY: best-effort), else KVBANK_DEFAULT_CLASS (kvbank.vllm.settings).

Strict requests are the ledger's, as they always were; best-effort ones are never in its books,
and what it is told keeps strict requests safe whatever best-effort ones do:

- Its supply counts blocks only running best-effort requests hold (no strict holder, no pin) as
  reclaimable (`reclaimable`), as `CacheView.ledger_supply` does: preempting those requests
  frees them. A strict hit counts blocks by their strict holders and pins (`strict_holders`):
  one only best-effort requests hold is idle to it, since leasing it takes it off the
  reclaimable part; counted by vLLM's reference count it would be a free page counted twice.
- vLLM preempts when an allocation fails: `running[-1]` under FCFS, which `running_order` makes
  a best-effort row while one runs (strict decode rows, strict prefill, then best-effort); the
  largest (priority, arrival) under the priority policy, so a best-effort request's priority is
  raised to at least the threshold and a strict one's lowered below it (`_align_priority`),
  which also keeps strict requests ahead of best-effort ones in vLLM's priority queue.
- vLLM's waiting loop never preempts, so before each schedule `make_room` preempts best-effort
  requests (the latest first, with vLLM's own `_preempt_request`) until vLLM's free blocks
  cover what the running requests and the waiting strict ones may allocate in this step
  (`step_need`, an upper bound per request), and the running set leaves a row for each waiting
  strict request.
- A preempted best-effort request leaves vLLM's waiting queue (where vLLM prepends it) and waits
  here; one preempted KVBANK_MAX_PREEMPTIONS times is promoted (`promotions`): submitted to the
  ledger as strict with a shape from where it is (`resumed_shape`: vLLM recomputes it from
  scratch, its output so far counted as prompt), so it is never preempted again and every
  request finishes.

A waiting best-effort request joins vLLM's waiting queue, behind every strict one, in arrival
order, when its prompt's uncached blocks fit vLLM's free blocks less `step_need` (what the
running requests and the queued ones may allocate this step); vLLM then schedules it, and may
preempt it, as it always does. The test is for throughput only: safety rests on the above.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvbank.capacity import CapacityModel, PageCount, RequestShape, count_pages
from kvbank.ledger import PeakShape, peak_shape
from kvbank.ledger.client import BestEffortFigures
from kvbank.service_class import TIERS, ServiceClass
from kvbank.vllm.groups import Tables, live
from kvbank.vllm.settings import Settings

TIER_ARG = "service_tier"  # the key of SamplingParams.extra_args a client's vllm_xargs sets


def tier_refusal(request: Any) -> str | None:
    """Why a request's `service_tier` is refused (None: it names a tier or none)."""
    tier = _extra_args(request).get(TIER_ARG)
    if tier is None or (isinstance(tier, str) and tier in TIERS):
        return None
    shown = repr(tier)[:40]
    return (
        f"vllm_xargs {TIER_ARG!r} is {shown}; this server offers {', '.join(TIERS)} (flex: "
        f"best-effort, may be preempted; priority: strict, never preempted; auto and default: "
        f"the pool's default class)"
    )


def _extra_args(request: Any) -> dict[str, Any]:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) or {}


def resumed_shape(model: CapacityModel, request: Any, count: PageCount) -> PeakShape | None:
    """A promoted request's shape from where it is: its output so far counted as prompt (vLLM
    recomputes a preempted request from scratch), what is left of its budget as output. None
    when that does not count the same pages as `count`, its count at arrival: it is then
    submitted without a shape, at its worst case until it finishes."""
    left = request.max_tokens - request.num_output_tokens
    if left < 1:
        return None
    resumed = count_pages(model, RequestShape(request.num_tokens, left))
    if resumed.per_label != count.per_label or resumed.output_tokens != left:
        return None
    return peak_shape(model, RequestShape(request.num_tokens, left), count=resumed)


class Classes:
    """The best-effort requests of one `KvbankScheduler` (`sched`, read and preempted through
    vLLM's own methods), and each request's class."""

    def __init__(self, sched: Any, tables: Tables, settings: Settings) -> None:
        self.sched = sched
        self.tables = tables
        self.pool = sched.kv_cache_manager.block_pool
        self.default = settings.default_class
        self.max_preemptions = settings.max_preemptions
        self.threshold = settings.best_effort_priority
        self.by_priority = str(getattr(sched.policy, "value", sched.policy)) == "priority"
        self.block_sizes = [
            int(group.kv_cache_spec.block_size) for group in sched.kv_cache_config.kv_cache_groups
        ]
        self.best_effort: dict[str, Any] = {}  # every best-effort request, wherever it is
        self.waiting: list[Any] = []  # best-effort, in none of vLLM's queues, by arrival
        self.resumed: dict[str, int] = {}  # promoted request -> its output when re-shaped
        self.last_reclaimable = 0
        self.preempted = 0  # best-effort preemptions, vLLM's and make_room's
        self.promoted = 0

    # ---- arrivals ------------------------------------------------------------------------------

    def class_of(self, request: Any) -> ServiceClass:
        tier = _extra_args(request).get(TIER_ARG)
        asked = TIERS.get(tier) if isinstance(tier, str) else None
        if asked is not None:
            return asked
        if self.by_priority and request.priority >= self.threshold:
            return ServiceClass.BEST_EFFORT
        return self.default

    def arrive(self, request: Any) -> bool:
        """Class a new request (its tier checked by `tier_refusal`); True when it is
        best-effort, queued here and never the ledger's."""
        best_effort = self.class_of(request) is ServiceClass.BEST_EFFORT
        self._align_priority(request, best_effort)
        if best_effort:
            self.best_effort[request.request_id] = request
            self._wait(request)
        return best_effort

    def _align_priority(self, request: Any, best_effort: bool) -> None:
        """Under the priority policy, every best-effort request after every strict one in
        vLLM's order (priority, then arrival): vLLM's victim and queue order follow it."""
        if not self.by_priority:
            return
        if best_effort:
            request.priority = max(request.priority, self.threshold)
        else:
            request.priority = min(request.priority, self.threshold - 1)

    def _wait(self, request: Any) -> None:
        keys = [r.arrival_time for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.arrival_time), request)

    def cancel(self, rid: str) -> bool:
        """A request left; True when it was best-effort (nothing of it is the ledger's)."""
        self.resumed.pop(rid, None)
        request = self.best_effort.pop(rid, None)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        return True

    def step_done(self) -> None:
        """Forget best-effort requests that finished (one preempted may finish on the output it
        had in flight, waiting here)."""
        for rid, request in list(self.best_effort.items()):
            if request.is_finished():
                self.cancel(rid)

    # ---- what the ledger is told ---------------------------------------------------------------

    def _holds(self) -> tuple[Counter[int], dict[int, Any]]:
        """Per block id, how many running best-effort requests hold it; and the blocks."""
        counts: Counter[int] = Counter()
        blocks: dict[int, Any] = {}
        running = _status("RUNNING")
        for rid, request in self.best_effort.items():
            if request.status != running:
                continue
            for group in self.tables.held(rid):
                for block in group:
                    counts[block.block_id] += 1
                    blocks[block.block_id] = block
        return counts, blocks

    def reclaimable(self) -> int:
        """Blocks only running best-effort requests hold: preempting them frees these (kept
        as `last_reclaimable` for `figures`, which the supply's sync asks right after)."""
        counts, blocks = self._holds()
        self.last_reclaimable = sum(1 for bid, n in counts.items() if blocks[bid].ref_cnt == n)
        return self.last_reclaimable

    def figures(self, later: object) -> BestEffortFigures | None:
        """What pickers route best-effort requests by, for a sidecar the schedule never waits on
        (`later`: the one a pod runs, which streams them; None elsewhere, where they cost a pass
        for nothing): the blocks only running best-effort requests hold, and what the others
        need to start, each its whole prompt in every group (no hit counted). Asked right
        after the supply (`reclaimable`), whose count it reuses."""
        if later is None:
            return None
        running, empty = _status("RUNNING"), [0] * len(self.block_sizes)
        backlog = sum(
            self._new_blocks(empty, 0, request.num_tokens)
            for request in self.best_effort.values()
            if request.status != running
        )
        return BestEffortFigures(self.last_reclaimable, backlog)

    def strict_holders(self) -> Callable[[Any], int]:
        """A block's holders that keep it out of the supply the ledger hears: strict requests
        and pins, not best-effort requests (what only they hold is reclaimable)."""
        counts, _ = self._holds()
        return lambda block: int(block.ref_cnt) - counts[block.block_id]

    def produced(self, request: Any) -> int:
        """Output tokens as the ledger counts them: a promoted request's from its promotion."""
        return int(request.num_output_tokens) - self.resumed.get(request.request_id, 0)

    def prompt_end(self, request: Any) -> int:
        """Positions a request's prefill computes: a promoted one's output so far too."""
        return int(request.num_prompt_tokens) + self.resumed.get(request.request_id, 0)

    # ---- before vLLM schedules -----------------------------------------------------------------

    def running_order(self, request: Any) -> tuple[bool, bool]:
        """`sched.running`'s sort key: strict decode rows, strict prefill chunks, best-effort."""
        prefill = (
            request.num_tokens_with_spec
            + request.num_output_placeholders
            - request.num_computed_tokens
            > 1
        )
        return request.request_id in self.best_effort, prefill

    def promotions(self, model: CapacityModel) -> list[tuple[Any, PageCount, PeakShape | None]]:
        """Waiting best-effort requests preempted `max_preemptions` times, strict from now on:
        each with its count at arrival and its shape from where it is (`resumed_shape`), for
        the caller to submit to the ledger. One whose in-flight output has not arrived waits
        for it: its shape is made from where it is."""
        due = [
            r
            for r in self.waiting
            if r.num_preemptions > 0
            and r.num_preemptions >= self.max_preemptions
            and not getattr(r, "num_stale_output_tokens", 0)
        ]
        promoted = []
        for request in due:
            rid = request.request_id
            self.waiting.remove(request)
            del self.best_effort[rid]
            self._align_priority(request, best_effort=False)
            self.promoted += 1
            count = count_pages(model, RequestShape(request.num_prompt_tokens, request.max_tokens))
            shape = resumed_shape(model, request, count)
            if shape is not None:  # without one its progress is counted from its arrival
                self.resumed[rid] = request.num_output_tokens
            promoted.append((request, count, shape))
        return promoted

    def before_schedule(self) -> None:
        """Make room for the strict requests, queue the best-effort ones that fit, strict ahead
        of best-effort in vLLM's waiting queue."""
        self.make_room()
        self.admit()
        self._strict_first()

    def make_room(self) -> None:
        sched = self.sched
        while True:
            victim = self._victim()
            if victim is None:
                return  # only strict requests run: the ledger's reservations cover them
            short = self.step_need(queued_best_effort=False) - self.pool.get_num_free_blocks()
            rows = len(sched.running) + self._strict_queued() - sched.max_num_running_reqs
            if short <= 0 and rows <= 0:
                return
            self._preempt(victim)

    def admit(self) -> None:
        sched = self.sched
        if not self.waiting:
            return
        spare = self.pool.get_num_free_blocks() - self.step_need(queued_best_effort=True)
        rows = sched.max_num_running_reqs - len(sched.running) - len(sched.waiting)
        for request in list(self.waiting):
            if rows <= 0:
                return
            if getattr(request, "num_stale_output_tokens", 0):
                continue  # vLLM resumes it once its in-flight output arrived
            cost, _ = self._queued_need(request, request.num_tokens)  # its whole prompt
            if cost > spare:
                return
            spare -= cost
            rows -= 1
            self.waiting.remove(request)
            sched._enqueue_waiting_request(request)  # as vLLM queues an arrival

    def step_need(self, queued_best_effort: bool) -> int:
        """Blocks this step's schedule may allocate, at most: running requests in vLLM's order,
        then the strict requests (and, if asked, the best-effort ones) in its waiting queue,
        each given tokens from the step's budget as vLLM gives them (its other caps only lower
        them)."""
        sched = self.sched
        budget = sched.max_num_scheduled_tokens
        ahead = sched.num_lookahead_tokens
        need = 0
        for request in sched.running:
            tokens = min(
                budget,
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens,
            )
            if tokens <= 0:
                continue
            budget -= tokens
            held = [len(group) for group in self.tables.held(request.request_id)]
            need += self._new_blocks(held, request.num_computed_tokens, tokens + ahead)
        for request in sched.waiting:
            if budget <= 0:
                break
            if not queued_best_effort and request.request_id in self.best_effort:
                continue
            blocks, tokens = self._queued_need(request, budget)
            budget -= tokens
            need += blocks
        return need

    def _queued_need(self, request: Any, budget: int) -> tuple[int, int]:
        """(blocks, tokens) of a waiting request's first chunk within `budget`: the blocks its
        hit lacks, and hit blocks only the cache holds (vLLM takes them off its free list)."""
        # (blocks, tokens) in vLLM 0.32; 0.33 adds a third value
        computed, hit_tokens = self.tables.manager.get_computed_blocks(request)[:2]
        hit = [live(group) for group in computed.blocks]
        idle = sum(1 for group in hit for block in group if block.ref_cnt == 0)
        tokens = min(request.num_tokens - hit_tokens, budget)
        held = [len(group) for group in hit] or [0] * len(self.block_sizes)
        ahead = self.sched.num_lookahead_tokens
        return idle + self._new_blocks(held, hit_tokens, tokens + ahead), tokens

    def _new_blocks(self, held: list[int], computed: int, tokens: int) -> int:
        """Blocks `tokens` more positions after `computed` take, per group at most the blocks
        that cover them (a window's table holds fewer than its positions' blocks)."""
        return sum(
            max(0, min(math.ceil((computed + tokens) / size) - n, math.ceil(tokens / size) + 1))
            for n, size in zip(held, self.block_sizes, strict=True)
        )

    def _strict_queued(self) -> int:
        return sum(1 for r in self.sched.waiting if r.request_id not in self.best_effort)

    def _strict_first(self) -> None:
        """vLLM's FCFS queue as strict requests, then best-effort ones (vLLM stops at the first
        request it cannot allocate for); its priority queue is in that order already."""
        queue = self.sched.waiting
        order = [r.request_id in self.best_effort for r in queue]
        if order == sorted(order):
            return
        best_effort = [r for r in queue if r.request_id in self.best_effort]
        queue.remove_requests(best_effort)
        for request in best_effort:
            queue.add_request(request)

    def _victim(self) -> Any:
        """The best-effort request vLLM would preempt: the last running one, or under the
        priority policy the largest (priority, arrival)."""
        running = [r for r in self.sched.running if r.request_id in self.best_effort]
        if not running:
            return None
        if self.by_priority:
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    def _preempt(self, request: Any) -> None:
        """Preempt as vLLM's schedule does: out of `running`, then `_preempt_request`."""
        sched = self.sched
        sched.running.remove(request)
        if hasattr(sched, "requires_kv_delivery"):  # vLLM 0.33; 0.32 has no such argument
            sched._preempt_request(
                request, time.monotonic(), drop_stale_output=sched.requires_kv_delivery
            )
        else:
            sched._preempt_request(request, time.monotonic())
        self._take_back(request)

    # ---- after vLLM scheduled ------------------------------------------------------------------

    def taken_back(self, preempted: set[str]) -> None:
        """Best-effort requests vLLM preempted in its schedule leave its waiting queue."""
        for rid in preempted & self.best_effort.keys():
            request = self.best_effort[rid]
            if request not in self.waiting and request.status == _status("PREEMPTED"):
                self._take_back(request)

    def _take_back(self, request: Any) -> None:
        self.sched.waiting.remove_request(request)
        self.preempted += 1
        self._wait(request)


def _status(name: str) -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus[name]
