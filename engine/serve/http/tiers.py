"""OpenAI's `service_tier` as kvbank's service classes, both ways.

A request asks: `flex` for best-effort, `priority` for strict, `auto`, `default` or nothing for
the pool's default class (`kvbank serve --default-class`). The response says what it got, which
is not always what it asked: the engine runs a request strict whatever it asks when its KV
cannot be rebuilt, when it is a group of n > 1 sequences (preempted whole or not at all), or
when the pool's policy is a baseline that honours no class.

- `flex`: it ran best-effort (it may have been preempted and resumed).
- `default`: it ran strict because strict is the pool's default and it asked for no tier, so a
  client of a pool that never heard of classes reads what OpenAI's standard tier answers.
- `priority`: it ran strict for any other reason: it asked for `priority`, or it asked for
  `flex` (or the pool's default is best-effort) and the engine ran it strict all the same.

`default` and `priority` make the same promise (admitted by the ledger, never preempted); the
two names only tell the client whether it was its own choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbank.engine.serve.http.errors import BadRequest, shown
from kvbank.service_class import DEFAULT, FLEX, PRIORITY, TIERS, ServiceClass


def requested_class(body: dict[str, Any]) -> ServiceClass | None:
    """The class `service_tier` asks for; None for the pool's default. Raises BadRequest naming
    `service_tier` for a tier this server does not offer."""
    tier = body.get("service_tier")
    if tier is None:
        return None
    if not isinstance(tier, str) or tier not in TIERS:
        raise BadRequest(
            f"'service_tier' is {shown(tier, 40)}; this server offers {', '.join(TIERS)} "
            f"(flex: best-effort, may be preempted; priority: strict, never preempted; auto "
            f"and default: the pool's default class)",
            "service_tier",
        )
    return TIERS[tier]


def echoed_tier(
    requested: ServiceClass | None, granted: Iterable[ServiceClass], pool_default: ServiceClass
) -> str:
    """The `service_tier` a response carries. A completion with several prompts says `flex` only
    when every prompt ran best-effort; one strict choice makes it a strict name."""
    classes = set(granted)
    if classes == {ServiceClass.BEST_EFFORT}:
        return FLEX
    if requested is None and pool_default is ServiceClass.STRICT:
        return DEFAULT
    return PRIORITY
