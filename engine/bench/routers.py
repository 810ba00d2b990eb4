"""The routers of the cluster bench (engine/bench/cluster.py): which replica a request goes to.

- `round-robin`: each replica in turn, what a plain Kubernetes Service gives.
- `least-kv`: the llm-d router's default scheduling profile as its EndpointPickerConfig sets
  it (the Gateway API Inference Extension's scorers, summed with weights queue 2, KV-cache
  utilisation 2, prefix 3, and the max-score picker, ties broken at random), on metrics scraped
  every `scrape_s` of virtual time (50 ms by default, as the router's metrics data source
  does). The scorers, as the extension defines them:
  - queue: `(max - q) / (max - min)` over the candidates' waiting-queue sizes, 1 for all when
    they are equal;
  - KV-cache utilisation: `1 - usage`, usage being vLLM's `kv_cache_usage_perc` (pages held by
    running requests over the pool; cached pages no request holds count as free);
  - prefix: matched blocks / the prompt's blocks, matched against the router's own record of
    where it sent each block (the approximate prefix index: prompt blocks chain-hashed, the
    walk stopping at the first block no pod holds, all of a routed prompt's blocks recorded
    for the pod picked, an LRU of `LRU_BLOCKS_PER_POD` per pod, at most `MAX_PREFIX_BLOCKS`).
- `kvbank`: the picker's rule (kvbank/picker/rule.py) on each replica's ledger as it is now,
  the figures a sidecar streams to the picker; a strict request no replica admits now is held
  in the picker's lobby (kvbank/picker/lobby.py) until one does, for `max_hold_s` at most.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvbank.capacity import RequestShape, count_pages
from kvbank.engine.bench.replica import Replica
from kvbank.engine.bench.workload import RequestSpec
from kvbank.ledger import Ledger
from kvbank.ledger.room import room_curve
from kvbank.picker import Answer, Pick, PodFigures, Release, RequestCount, count_request, pick
from kvbank.picker.lobby import Lobby
from kvbank.picker.prefix import MAX_PREFIX_BLOCKS, PrefixRecord, prompt_blocks
from kvbank.picker.rule import best_effort_room
from kvbank.service_class import ServiceClass

ROUTERS = ("round-robin", "least-kv", "kvbank")
SCRAPE_S = 0.05
# The llm-d router's default profile (EndpointPickerConfig): queue 2, KV-cache utilisation 2,
# prefix 3.
QUEUE_WEIGHT, KV_WEIGHT, PREFIX_WEIGHT = 2.0, 2.0, 3.0
# The prefix scorer's defaults: at most 256 blocks matched (MAX_PREFIX_BLOCKS), 31,250 blocks
# remembered per pod.
LRU_BLOCKS_PER_POD = 31250


@dataclass(frozen=True)
class Placed:
    """A request the router held, now answered: `since` is when it arrived."""

    spec: RequestSpec
    answer: Answer
    since: float


class Router(Protocol):
    name: str

    def route(self, spec: RequestSpec, now: float) -> Answer | None:
        """Where `spec` goes, or None: the router holds it (`release` answers it later)."""
        ...

    def release(self, now: float) -> list[Placed]:
        """The held requests that can go now, in the order they go."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = replicas
        self._next = 0

    def route(self, spec: RequestSpec, now: float) -> Answer:
        index = self._next
        self._next = (index + 1) % len(self.replicas)
        return Pick(str(index))

    def release(self, now: float) -> list[Placed]:
        return []


class LeastKv:
    """The llm-d router's default scorers on metrics that lag by a scrape interval."""

    name = "least-kv"

    def __init__(self, replicas: Sequence[Replica], scrape_s: float, seed: int) -> None:
        self.replicas = replicas
        self.scrape_s = scrape_s
        self._scraped_at: float | None = None
        self._queues: list[int] = []
        self._usage: list[float] = []
        self._index = [PrefixRecord(LRU_BLOCKS_PER_POD) for _ in replicas]
        self._rng = random.Random(seed)
        self.block_tokens = replicas[0].scenario.model.page_size

    def _scrape(self, now: float) -> None:
        """Read every replica's gauges when the last scrape is a scrape interval old: the
        figures then stand until the next one."""
        tick = now - (now % self.scrape_s) if self.scrape_s > 0 else now
        if self._scraped_at is not None and tick <= self._scraped_at:
            return
        self._scraped_at = tick
        self._queues = [r.engine.num_waiting for r in self.replicas]
        self._usage = [r.engine.kv.pool.held / r.engine.kv.pool.usable_pages for r in self.replicas]

    def route(self, spec: RequestSpec, now: float) -> Answer:
        self._scrape(now)
        blocks = prompt_blocks(spec.prompt, self.block_tokens, MAX_PREFIX_BLOCKS)
        low, high = min(self._queues), max(self._queues)
        scores: list[float] = []
        for index in range(len(self.replicas)):
            queue = 1.0 if high == low else (high - self._queues[index]) / (high - low)
            kv = 1.0 - min(1.0, self._usage[index])
            prefix = self._index[index].matched(blocks) / len(blocks) if blocks else 0.0
            scores.append(QUEUE_WEIGHT * queue + KV_WEIGHT * kv + PREFIX_WEIGHT * prefix)
        best = max(scores)
        chosen = self._rng.choice([i for i, s in enumerate(scores) if s == best])
        self._index[chosen].record(blocks)
        return Pick(str(chosen))

    def release(self, now: float) -> list[Placed]:
        return []


class KvbankRouter:
    """The picker's rule on each replica's ledger figures, read at the moment of the pick."""

    name = "kvbank"

    def __init__(self, replicas: Sequence[Replica], max_hold_s: float) -> None:
        self.replicas = replicas
        self.lobby = Lobby(max_hold_s)
        self._held: dict[str, RequestSpec] = {}
        scenario = replicas[0].scenario
        self.model = scenario.model
        self.pool_pages = scenario.pages
        self.label = next(iter(self.model.kv_slots))
        for replica in replicas:
            ledger_of(replica)  # refuse a policy without a ledger before the first request

    def count(self, spec: RequestSpec) -> RequestCount:
        cls = spec.cls
        shape = RequestShape(
            prompt_tokens=len(spec.prompt),
            max_tokens=cls.max_tokens,
            extra_tokens=dict(cls.fixed_label_tokens or {}),
            labels=cls.only_labels,
        )
        start = None
        if cls.service_class is ServiceClass.BEST_EFFORT:
            # What a best-effort admission needs at once: its prompt's pages and one step.
            start = count_pages(self.model, replace(shape, max_tokens=1))
        return count_request(
            self.model,
            shape,
            self.pool_pages,
            cls.service_class,
            None if start is None else start.total,
            range(len(spec.prompt) // self.model.page_size),
        )

    def figures(self, index: int, request: RequestCount, prompt: Sequence[int]) -> PodFigures:
        replica = self.replicas[index]
        engine = replica.engine
        ledger = ledger_of(replica)
        books = ledger.books
        kv = engine.kv
        waiting = tuple(entry.pages for entry in books.waiting.values())
        # When each running strict request may finish: its expected output (the mean the pod
        # has seen, or its whole budget once past it) at the pod's current step time.
        releases = []
        mean = replica.mean_output
        for rid, reservation in books.running.items():
            req = engine.sched.running.get(rid)
            if req is None:
                continue
            produced = len(req.output)
            expected = req.max_output if mean is None or produced >= mean else mean
            left = max(1.0, min(req.max_output, expected) - produced)
            releases.append(Release(left * replica.step_s, reservation.reserved))
        best_effort = getattr(engine.policy, "best_effort", None)
        queued_best_effort = 0 if best_effort is None else best_effort.backlog_pages
        # The ledger's own headroom, as the sidecar streams it to the picker: supply less the
        # conservative outstanding, or with peak-fit less the timeline's highest demand.
        headroom = min(ledger.usable_pages, ledger.headroom)
        room = best_effort_room(headroom, sum(waiting), kv.reclaimable, queued_best_effort)
        chain = kv.index.match(self.label, prompt, len(request.prefix_blocks))
        refcount = kv.pool.refcount
        blocks = request.prefix_blocks
        held = frozenset(blocks[i] for i, page in enumerate(chain) if refcount[page] > 0)
        return PodFigures(
            name=str(index),
            usable_pages=ledger.usable_pages,
            headroom_pages=headroom,
            waiting_pages=waiting,
            releases=tuple(sorted(releases, key=lambda r: r.eta_s)),
            best_effort_room_pages=min(ledger.usable_pages, room),
            best_effort_backlog_pages=queued_best_effort,
            cached_blocks=frozenset(blocks[: len(chain)]),
            held_blocks=held,
            room=room_curve(ledger),
        )

    def pods(self, request: RequestCount, prompt: Sequence[int]) -> list[PodFigures]:
        return [self.figures(i, request, prompt) for i in range(len(self.replicas))]

    def route(self, spec: RequestSpec, now: float) -> Answer | None:
        request = self.count(spec)
        if self.lobby.max_hold_s > 0 and spec.cls.service_class is ServiceClass.STRICT:
            # Behind the requests held before it, even when a pod admits it now: the lobby
            # decides whether it may pass them.
            self.lobby.enter(spec.rid, request, now)
            self._held[spec.rid] = spec
            return None
        return pick(request, self.pods(request, spec.prompt))

    def release(self, now: float) -> list[Placed]:
        placed: list[Placed] = []
        claimed: set[str] = set()
        for rid in self.lobby.in_order():
            spec = self._held[rid]
            request = self.lobby.request(rid)
            answer = self.lobby.ask(rid, self.pods(request, spec.prompt), now)
            if answer is None:
                claimed.add(self.lobby.claim(rid) or "")
                if len(claimed - {""}) >= len(self.replicas):
                    break  # every replica is waited for: nobody further back can go
                continue
            placed.append(Placed(spec, answer, self.lobby.since(rid)))
            self.lobby.leave(rid)
            del self._held[rid]
            if isinstance(answer, Pick):
                # The bench places it at once (the picker's hold on the sidecar): the next
                # request asked sees its pages.
                return placed
        return placed


def ledger_of(replica: Replica) -> Ledger:
    """The replica's embedded ledger; a policy without one cannot feed the picker."""
    backend = getattr(replica.engine.policy, "backend", None)
    ledger = getattr(backend, "ledger", None)
    if not isinstance(ledger, Ledger):
        raise ValueError(
            f"--router kvbank reads each replica's ledger, and policy {replica.policy!r} keeps "
            f"none; choose a ledger policy (banker, peak, peak+backfill, banker+backfill)"
        )
    return ledger


def make_router(
    name: str, replicas: Sequence[Replica], scrape_s: float, seed: int, max_hold_s: float
) -> Router:
    if name == "round-robin":
        return RoundRobin(replicas)
    if name == "least-kv":
        return LeastKv(replicas, scrape_s, seed)
    if name == "kvbank":
        return KvbankRouter(replicas, max_hold_s)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)} or all")
