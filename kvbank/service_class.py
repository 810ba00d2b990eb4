"""A request's service class: what the pool promises it.

- `strict`: admitted by the ledger's test, never preempted, never paused (the guarantee).
- `best-effort`: reserves its prompt plus an estimate of its output, runs on what strict requests
  do not need, and may be preempted when room runs out.

A request whose KV cannot be rebuilt (fixed label tokens: an image's tokens, an audio window) is
strict whatever its client asks, since preempting it would lose what it holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ServiceClass(enum.StrEnum):
    STRICT = "strict"
    BEST_EFFORT = "best-effort"


# OpenAI's `service_tier` names a client may ask for, and the class each picks (None: the pool's
# default): kvbank's HTTP server (engine/serve/http/tiers.py) and its vLLM plug-in
# (kvbank/vllm/classes.py) read the same table.
FLEX, PRIORITY, DEFAULT = "flex", "priority", "default"
TIERS: dict[str, ServiceClass | None] = {
    "auto": None,
    DEFAULT: None,
    FLEX: ServiceClass.BEST_EFFORT,
    PRIORITY: ServiceClass.STRICT,
}


class Victim(enum.StrEnum):
    """Which best-effort request a shortage preempts."""

    NEWEST = "newest"  # the most recently arrived
    CHEAPEST = "cheapest"  # the one whose rebuild costs least after host reload


class Estimate(enum.StrEnum):
    """How a best-effort admission estimates the request's output (engine/admission/estimate.py)."""

    LEARNED = "learned"  # the output lengths the pool has seen for the class
    RATIO = "ratio"  # a decaying fraction of the remaining budget (SGLang's new_token_ratio)


DEFAULT_MAX_PREEMPTIONS = 2


@dataclass(frozen=True)
class ClassPolicy:
    """A pool's class settings (ModelPool `spec.admission`, `kvbank serve` flags).

    `max_preemptions`: a best-effort request preempted this many times is next admitted by the
    strict test, so it then runs to completion (no livelock, bounded waste)."""

    default_class: ServiceClass = ServiceClass.STRICT
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    victim: Victim = Victim.NEWEST
    estimate: Estimate = Estimate.LEARNED


def effective_class(
    requested: ServiceClass | None, default: ServiceClass, preemptible: bool
) -> ServiceClass:
    """The class a request runs under: what it asked for (or the pool's default), and strict
    whenever it cannot be preempted (its KV cannot be rebuilt, it is a group of sequences, or
    the policy does not run classes)."""
    if not preemptible:
        return ServiceClass.STRICT
    return requested if requested is not None else default
