"""Everything one ModelPool renders, in apply order: config before the pods that mount it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.capacity import Holdability
from kvbank.modelpool import ModelPool
from kvbank.operator.render.engine_config import config_data, config_hash, config_map
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.operator.render.services import disruption_budget, headless_service, traffic_service
from kvbank.operator.render.workloads import workload


@dataclass(frozen=True)
class Rendered:
    manifests: list[dict[str, Any]]
    config_hash: str
    workload: Workload


def render_pool(
    pool: ModelPool,
    held: Holdability,
    owner: Owner,
    spec: Mapping[str, Any],
    settings: RenderSettings,
    kind: Workload,
) -> Rendered:
    data = config_data(pool, held, owner, spec)
    digest = config_hash(data)
    manifests = [
        config_map(owner, data),
        headless_service(owner, settings),
        traffic_service(owner, settings, kind),
        disruption_budget(owner),
        workload(kind, pool, owner, settings, digest),
    ]
    return Rendered(manifests, digest, kind)
