"""The decisions a policy returns and the scheduler carries out (engine/scheduler.py
`Scheduler.carry_out`), one at a time: a policy's `admit` yields each and resumes once it is
done, so the policy reads the cache as the decision left it. Admission only decides; it never
calls the scheduler or changes the cache itself.

- `Start`: admit a waiting request, leasing `lease` (its cached prefix, per label). Pins past
  the lease are dropped.
- `Pin`: hold more of a waiting request's cached hit so that eviction cannot take it before a
  decision that counted it is applied, within `max_idle` pages of headroom.
- `Reject`: finish a waiting request the ledger refused.
- `Preempt`: preempt a running request. The baselines return it on a shortage (recompute,
  requeued at the head). With `cache`, kvbank's policies preempt a best-effort request: its
  computed pages become cache, its output's too (eviction takes them tail first, only as many
  as the shortage needs), and it is requeued under its arrival time; readmission leases what is
  still cached or on host. They yield it from `admit` to make room for a strict start, or
  return it on a shortage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank.engine.kv.cache import Chains
from kvbank.engine.request import Request


@dataclass(frozen=True)
class Start:
    req: Request
    lease: Chains = field(default_factory=dict)


@dataclass(frozen=True)
class Pin:
    req: Request
    max_idle: int
    sole_costs: bool = False  # a page exactly one holder has costs as much as an idle one


@dataclass(frozen=True)
class Reject:
    req: Request


@dataclass(frozen=True)
class Preempt:
    req: Request
    cache: bool = False  # keep its pages as cache and requeue it by arrival


Action = Start | Pin | Reject | Preempt
