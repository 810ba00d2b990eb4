"""The ConfigMap every rank mounts: the ModelPool manifest the engine and sidecar parse with
`parse_modelpool`, and the figures the operator derived from it, so no rank recomputes them
differently. Its hash, stamped on the pod template, is what rolls the pods on a spec change."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvbank.capacity import Holdability
from kvbank.modelpool import API_GROUP, API_VERSION, KIND, ModelPool
from kvbank.operator.render.names import (
    ENGINE_FILE,
    LABEL_CONFIG_HASH,
    MODEL_CONFIG_FILE,
    POOL_FILE,
    Owner,
    config_name,
    metadata,
)


def engine_config(pool: ModelPool, held: Holdability) -> dict[str, Any]:
    return {
        "pool": f"{pool.namespace}/{pool.name}",
        "model": pool.model_name,
        "tensorParallel": pool.tensor_parallel,
        "pageSize": pool.kv.page_size,
        "poolPages": held.pages,
        "speculativeTokens": pool.kv.speculative_tokens,
        "kvSlots": {
            label: {"prompt": s.prompt, "output": s.output, "fixed": s.fixed}
            for label, s in pool.kv_slots.items()
        },
        "limits": {"maxSeqLen": pool.limits.max_seq_len, "maxTokens": pool.limits.max_tokens},
        "admission": {
            "policy": pool.admission.policy,
            "backfill": pool.admission.backfill,
            "minConcurrency": pool.admission.min_concurrency,
        },
        "worstRequestPages": held.worst_request_pages,
        "worstConcurrency": held.worst_concurrency,
    }


def pool_manifest(owner: Owner, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest as `kvbank check` and the sidecar's `--pool` read it: no server fields."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": owner.name, "namespace": owner.namespace},
        "spec": dict(spec),
    }


def config_data(
    pool: ModelPool,
    held: Holdability,
    owner: Owner,
    spec: Mapping[str, Any],
    model_config: str | None = None,
) -> dict[str, str]:
    """`model_config`: a fromConfig pool's config.json as judged, which `spec` names."""
    # JSON is YAML too; sorted keys make the text, and so the hash, a function of content only.
    data = {
        POOL_FILE: json.dumps(pool_manifest(owner, spec), sort_keys=True, indent=2) + "\n",
        ENGINE_FILE: json.dumps(engine_config(pool, held), sort_keys=True, indent=2) + "\n",
    }
    if model_config is not None:
        data[MODEL_CONFIG_FILE] = model_config
    return data


def config_hash(data: Mapping[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(dict(data), sort_keys=True).encode()).hexdigest()
    return digest[:16]


def config_map(owner: Owner, data: Mapping[str, str]) -> dict[str, Any]:
    digest = config_hash(data)
    meta = metadata(config_name(owner.name, digest), owner, "config")
    meta["labels"][LABEL_CONFIG_HASH] = digest
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "immutable": True,
        "data": dict(data),
    }
