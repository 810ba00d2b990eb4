"""What preemption costs each service class, counted by the serve layer from what the engine
shows: its requests' own preemption counts and the rows its runner computes.

- Preemptions: when the scheduler's total rises, the requests whose `preemptions` rose are
  found among the waiting and running ones (a preempted request is requeued, so it is there)
  and counted under their class.
- Recomputed positions: a `RecomputeMeter` stands between the engine and its runner and keeps,
  per request, the highest position whose KV was ever written; a row that writes below it again
  (after a preemption, what the prefix cache and the host tier could not give back) is counted
  once per recomputation, as `kvbank bench` counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbank.engine.engine import Engine
from kvbank.engine.runner import ModelRunner, StepBatch, StepResult
from kvbank.service_class import ServiceClass

Count = Callable[[ServiceClass, int], None]


class RecomputeMeter:
    """A runner that counts the positions each row writes a second time, then runs the real
    one. The engine reads `eos_token_id` from it every step: that is the inner runner's."""

    def __init__(self, inner: ModelRunner, engine: Engine, on_recomputed: Count) -> None:
        self.inner = inner
        self.engine = engine
        self.on_recomputed = on_recomputed
        self.computed_to: dict[str, int] = {}  # per request: highest position written, plus one

    @property
    def eos_token_id(self) -> int:
        return self.inner.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, token: int) -> None:
        self.inner.eos_token_id = token

    def run(self, batch: StepBatch) -> StepResult:
        running = self.engine.sched.running
        for row in batch.rows:
            end = row.start_pos + len(row.token_ids)
            top = self.computed_to.get(row.rid, 0)
            again = max(0, min(end, top) - row.start_pos)
            req = running.get(row.rid)
            if again and req is not None:
                self.on_recomputed(req.service_class, again)
            self.computed_to[row.rid] = max(top, end)
        return self.inner.run(batch)

    def release(self, rid: str) -> None:
        self.computed_to.pop(rid, None)
        self.inner.release(rid)

    def __getattr__(self, name: str) -> Any:  # what else a caller reads of the real runner
        if name == "inner":  # not set yet (a copy being built): no lookup through itself
            raise AttributeError(name)
        return getattr(self.inner, name)


class PreemptionCounter:
    """Preemptions by class, from the scheduler's total and each request's own count."""

    def __init__(self, on_preempted: Count) -> None:
        self.on_preempted = on_preempted
        self.total_seen = 0
        self.seen: dict[str, int] = {}  # per request that was preempted: preemptions counted

    def observe(self, engine: Engine, finished: list[str]) -> None:
        sched = engine.sched
        total = sched.stats.preemptions
        if total > self.total_seen:
            self.total_seen = total
            for req in (*sched.waiting, *sched.running.values()):
                counted = self.seen.get(req.rid, 0)
                if req.preemptions > counted:
                    self.on_preempted(req.service_class, req.preemptions - counted)
                    self.seen[req.rid] = req.preemptions
        for rid in finished:
            self.seen.pop(rid, None)
