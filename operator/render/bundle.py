"""Everything one ModelPool renders, in apply order: the token Secret and config before the pods
that mount them. The Secret is created, never applied (render.token says why)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.capacity import Holdability
from kvbank.deployment import Deployment
from kvbank.modelpool import ModelPool
from kvbank.operator.render.engine_config import config_data, config_hash, config_map
from kvbank.operator.render.engines import pods_per_group
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.operator.render.picker import render_picker
from kvbank.operator.render.services import disruption_budget, headless_service, traffic_service
from kvbank.operator.render.sidecar_tls import PoolTLS
from kvbank.operator.render.token import token_secret
from kvbank.operator.render.workloads import workload


@dataclass(frozen=True)
class Rendered:
    token_secret: dict[str, Any]  # created before the manifests are applied
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
    deployment: Deployment | None = None,
    tls: PoolTLS | None = None,
    model_config: str | None = None,
) -> Rendered:
    """Raises MissingSidecarToken when `settings` has no token: pods without one cannot start.
    `model_config`: a fromConfig pool's config.json as judged, rendered beside the manifest."""
    secret = token_secret(owner, settings.sidecar_token)
    data = config_data(pool, held, owner, spec, model_config)
    digest = config_hash(data)
    manifests = [
        config_map(owner, data),
        headless_service(owner, settings),
        traffic_service(owner, settings, kind, pods_per_group(pool, deployment or Deployment())),
        disruption_budget(owner),
        workload(kind, pool, owner, settings, digest, secret["metadata"]["name"], deployment, tls),
        *render_picker(
            pool,
            owner,
            settings,
            kind,
            deployment or Deployment(),
            digest,
            secret["metadata"]["name"],
            tls,
        ),
    ]
    return Rendered(secret, manifests, digest, kind)
