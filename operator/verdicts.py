"""What judging a pool decided, and the verdicts remembered so the repair timer renders without
judging again.

`Accepted` is what a judged (or earlier accepted) pool renders from. The remembered verdicts
are keyed by (pool uid, generation, config digest): the repair timer renders the generation
(and, for a fromConfig pool, the config.json) reconcile judged without searching the worst case
again. Bounded by MAX_HELD: when full it is emptied, and
a pool not found is judged again (a fromConfig one by reconcile).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.capacity import Holdability
from kvbank.deployment import Deployment
from kvbank.modelpool import ModelPool
from kvbank.operator.model_config import KvGroupFigures
from kvbank.operator.render.names import Workload


@dataclass(frozen=True)
class Accepted:
    """What a judged (or earlier accepted) pool renders from. A fromConfig pool's `pool` is
    pinned to its layout (`model_config.pinned`); `model_config` is the config.json it was
    judged on, as the ranks get it, and `groups` its figures per KV group."""

    pool: ModelPool
    held: Holdability
    deployment: Deployment
    kind: Workload
    model_config: str | None = None
    groups: tuple[KvGroupFigures, ...] = ()


HeldKey = tuple[str, int, str]
Judged = tuple[Holdability, tuple[KvGroupFigures, ...]]  # the verdict, a configured pool's groups
HELD: dict[HeldKey, Judged] = {}
MAX_HELD = 4096


def held_key(doc: Mapping[str, Any], model_config: str | None) -> HeldKey:
    digest = "" if model_config is None else hashlib.sha256(model_config.encode()).hexdigest()
    return str(doc["metadata"]["uid"]), int(doc["metadata"].get("generation") or 0), digest


def remember(doc: Mapping[str, Any], model_config: str | None, judged: Judged) -> None:
    if len(HELD) >= MAX_HELD:
        HELD.clear()
    HELD[held_key(doc, model_config)] = judged


def recall(doc: Mapping[str, Any], model_config: str | None) -> Judged | None:
    """The verdict reconcile (or an earlier repair) reached for this generation and config."""
    return HELD.get(held_key(doc, model_config))
