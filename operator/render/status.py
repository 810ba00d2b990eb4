"""ModelPool status: conditions and figures, built as dicts for one merge patch of /status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ACCEPTED, READY, DEGRADED = "Accepted", "Ready", "Degraded"
MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def conditions(
    current: Sequence[Mapping[str, Any]] | None,
    updates: Sequence[Condition],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The current conditions with `updates` applied. lastTransitionTime moves only when a
    condition's status changes, so a reader can tell how long it has been so."""
    by_type = {c.get("type"): dict(c) for c in current or () if isinstance(c, Mapping)}
    for update in updates:
        status = "True" if update.status else "False"
        old = by_type.get(update.type)
        moved = old is None or old.get("status") != status
        by_type[update.type] = {
            "type": update.type,
            "status": status,
            "reason": update.reason,
            "message": update.message[:MAX_MESSAGE],
            "observedGeneration": generation,
            "lastTransitionTime": (
                now if moved or old is None else old.get("lastTransitionTime", now)
            ),
        }
    order = {ACCEPTED: 0, READY: 1, DEGRADED: 2}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], 9), str(c["type"])))


def status_patch(
    doc: Mapping[str, Any], updates: Sequence[Condition], now: str, **figures: Any
) -> dict[str, Any]:
    """A reconcile's /status patch: the generation it saw, `figures`, and the pool's current
    conditions (read off `doc`) with `updates` applied."""
    generation = int(doc["metadata"].get("generation") or 0)
    current = (doc.get("status") or {}).get("conditions")
    return {
        "observedGeneration": generation,
        **figures,
        "conditions": conditions(current, updates, generation, now),
    }
