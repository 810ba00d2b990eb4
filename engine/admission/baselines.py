"""The policies other engines use, run by the same engine for comparison (docs/benchmarks.md
compares them). Each admits FIFO from the head and differs in what it counts and what it does
when a running request cannot grow:

- optimistic   (a plain engine) admit when the prompt's uncached pages fit; grow on demand;
               a request that cannot grow stalls. Can deadlock.
- preempt      (vLLM, recompute) admit like optimistic; on a shortage preempt the most recently
               admitted running request and requeue it at the head.
- no-evict     (TensorRT-LLM GUARANTEED_NO_EVICT) admit when the remaining worst-case claims of
               the running requests plus the head's whole worst case fit the supply; a prefix hit
               is not counted as supply. Never preempts.
- ratio        (SGLang) reserve new_token_ratio x remaining output: 0.7 at start, decaying
               linearly to 0.1 over 600 steps; on a shortage retract the request with the least
               output and reset the ratio to 0.7.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from kvbank.engine import sequences as groups
from kvbank.engine.admission.actions import Action, Preempt, Start
from kvbank.engine.admission.policy import AdmissionPolicy
from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request
from kvbank.ledger import InvariantBreach


class FifoPolicy(AdmissionPolicy):
    """Admit from the head while `fits` says so; leasing the head's hit as it starts."""

    def admit(self) -> Iterator[Action]:
        view = self.view
        while view.waiting and view.can_start():
            req = view.waiting[0]
            chains = view.kv.peek(req)
            if not self.fits(req, chains):
                return
            yield Start(req, chains)

    def fits(self, req: Request, chains: Chains) -> bool:
        raise NotImplementedError

    def _hit(self, chains: Chains) -> tuple[int, int]:
        """(pages, idle pages) of a hit."""
        return sum(len(c) for c in chains.values()), self.view.kv.idle_pages(chains)

    def _prompt_fits(self, req: Request, chains: Chains) -> bool:
        hit, idle = self._hit(chains)
        return groups.start_pages(req) - hit <= self.view.kv.supply - idle


class OptimisticPolicy(FifoPolicy):
    name = "optimistic"

    def fits(self, req: Request, chains: Chains) -> bool:
        return self._prompt_fits(req, chains)


class PreemptPolicy(OptimisticPolicy):
    name = "preempt"

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        running = self.view.running
        return Preempt(running[next(reversed(running))])  # the most recently admitted


class NoEvictPolicy(FifoPolicy):
    name = "no-evict"

    def fits(self, req: Request, chains: Chains) -> bool:
        claims = sum(r.worst - groups.held(r) for r in self.view.running.values())
        return claims + req.count.total <= self.view.kv.supply

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        raise InvariantBreach(
            f"no-evict request {req.rid!r} could not grow: it holds {req.held} of its "
            f"{req.count.total} pages and supply is {self.view.kv.supply}"
        )


class RatioPolicy(FifoPolicy):
    name = "ratio"
    INITIAL = 0.7
    FLOOR = 0.1
    DECAY_STEPS = 600

    def __init__(self) -> None:
        self.ratio = self.INITIAL
        self.retractions = 0

    def _estimate(self, req: Request) -> int:
        """Pages the request is expected to reach: its tokens so far plus ratio x what is left
        of its output budget."""
        ratio, budget = self.ratio, req.max_output
        return groups.pages_at(
            req, lambda seq: seq.num_tokens + math.ceil(ratio * (budget - len(seq.output)))
        )

    def fits(self, req: Request, chains: Chains) -> bool:
        hit, idle = self._hit(chains)
        running = self.view.running.values()
        expected = sum(max(0, self._estimate(r) - groups.held(r)) for r in running)
        return expected + self._estimate(req) - hit <= self.view.kv.supply - idle

    def on_shortage(self, req: Request, spared: bool = False) -> Preempt | None:
        running = self.view.running.values()
        victim = min(running, key=lambda r: (len(r.output), -r.admitted_at))
        self.ratio = self.INITIAL
        self.retractions += 1
        return Preempt(victim)

    def end_step(self) -> None:
        step = (self.INITIAL - self.FLOOR) / self.DECAY_STEPS
        self.ratio = max(self.FLOOR, self.ratio - step)


BASELINES: tuple[type[FifoPolicy], ...] = (
    OptimisticPolicy,
    PreemptPolicy,
    NoEvictPolicy,
    RatioPolicy,
)
