"""A `fromConfig` pool's config.json, as the cluster holds it: the key of the ConfigMap that
`fromConfig.configMap` names, in the pool's own namespace.

The operator reads no files, so `fromConfig.path` (a file beside a manifest on someone's disk)
is refused with what to write instead. What a ConfigMap holds is hostile input (anyone who may
edit ConfigMaps in the namespace writes it): its text goes through the bounded reader `kvbank
check` reads a file with, and every problem, a missing ConfigMap or key included, is one line
naming the field to fix. Reading (`read_model_config`, async, through `Cluster`) is apart from
judging (`configured`, pure), so the judgement runs in the worker thread `decide` runs in.

Serving it: the config judged is rendered into the ranks' ConfigMap beside their manifest,
whose fromConfig names that copy (`served_text`, `served_spec`), so the engine and the sidecar
resolve the layout the webhook judged and not whatever the ConfigMap holds when a pod starts;
the rendered pool is pinned to the judged page count and groups (`pinned`); and a pool whose
engine would not run the layout is refused (`serving_refusals`).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvbank.capacity import worst_case
from kvbank.capacity.configfile import MAX_CONFIG_BYTES, parse_config_text
from kvbank.capacity.configured import (
    FROM_CONFIG,
    ConfigSourceError,
    ConfiguredModel,
    resolve_text,
)
from kvbank.capacity.modellayout import Kind
from kvbank.deployment import Deployment
from kvbank.fields import quote
from kvbank.modelpool import ModelPool, SpecError, parse_modelpool
from kvbank.operator.cluster import Cluster
from kvbank.operator.render.names import MODEL_CONFIG_FILE

MAX_KEYS_NAMED = 8  # of a ConfigMap's keys, in the message saying the one asked for is not there


@dataclass(frozen=True)
class ModelConfig:
    """A pool's config.json text as read from its ConfigMap, or why there is none (`problem`);
    `where` names the copy in messages (ConfigMap NAMESPACE/NAME key KEY)."""

    where: str
    text: str | bytes | None = None
    problem: ConfigSourceError | None = None


def _missing_map(pool: ModelPool, name: str, key: str) -> ConfigSourceError:
    return ConfigSourceError(
        f"{FROM_CONFIG}.configMap.name",
        f"names ConfigMap {name}, which namespace {pool.namespace} does not have. Create it "
        f"from the model's config.json (kubectl create configmap {name} -n {pool.namespace} "
        f"--from-file={key}=config.json) or name the one that holds it",
    )


def _missing_key(where: str, key: str, present: list[str]) -> ConfigSourceError:
    named = ", ".join(quote(k, 64) for k in present[:MAX_KEYS_NAMED])
    more = f" and {len(present) - MAX_KEYS_NAMED} more" if len(present) > MAX_KEYS_NAMED else ""
    has = f"it has {named}{more}" if present else "it has no keys"
    return ConfigSourceError(
        f"{FROM_CONFIG}.configMap.key",
        f"{quote(key)} is not a key of {where} ({has}). Set key to the one holding the "
        f"model's config.json, or add it to the ConfigMap",
    )


def _binary(where: str, encoded: Any) -> bytes | ConfigSourceError:
    """A binaryData value: base64 as the apiserver stores it, bounded before decoding."""
    field = f"{FROM_CONFIG}.configMap.key"
    if not isinstance(encoded, str):
        return ConfigSourceError(field, f"{where} holds {type(encoded).__name__}, not base64")
    if len(encoded) > (MAX_CONFIG_BYTES // 3 + 1) * 4:
        return ConfigSourceError(
            field, f"{where} is over {MAX_CONFIG_BYTES} bytes; a model's config is a few KiB"
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return ConfigSourceError(field, f"{where} is not valid base64 binaryData")


def _text_of(config_map: str, found: Mapping[str, Any], key: str) -> ModelConfig:
    """`key` of the ConfigMap `found` (named `config_map` in messages): data, or binaryData."""
    where = f"{config_map} key {key}"
    data = found.get("data")
    binary = found.get("binaryData")
    data = data if isinstance(data, Mapping) else {}
    binary = binary if isinstance(binary, Mapping) else {}
    if key in data:
        value = data[key]
        if not isinstance(value, str):
            problem = ConfigSourceError(
                f"{FROM_CONFIG}.configMap.key", f"{where} holds {type(value).__name__}, not text"
            )
            return ModelConfig(where, problem=problem)
        return ModelConfig(where, text=value)
    if key in binary:
        decoded = _binary(where, binary[key])
        if isinstance(decoded, ConfigSourceError):
            return ModelConfig(where, problem=decoded)
        return ModelConfig(where, text=decoded)
    present = sorted(str(k) for k in (*data, *binary))
    return ModelConfig(where, problem=_missing_key(config_map, key, present))


async def read_model_config(cluster: Cluster, doc: Mapping[str, Any]) -> ModelConfig | None:
    """The config.json of a pool whose architecture is `fromConfig.configMap`; None for any
    other pool, and for a spec that does not parse (the judgement says why)."""
    try:
        pool = parse_modelpool(doc)
    except SpecError:
        return None
    source = pool.from_config
    if source is None or source.config_map is None:
        return None
    name, key = source.config_map, source.key
    config_map = f"ConfigMap {pool.namespace}/{name}"
    found = await cluster.get("v1", "ConfigMap", name, pool.namespace)
    if found is None:
        return ModelConfig(f"{config_map} key {key}", problem=_missing_map(pool, name, key))
    return _text_of(config_map, found, key)


def config_map_of(doc: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the ConfigMap a pool takes its config.json from: the key by which
    the operator finds the pools to judge again when that ConfigMap changes. None for a pool
    described by hand, one that names a path, and a spec that does not parse."""
    try:
        pool = parse_modelpool(doc)
    except SpecError:
        return None
    source = pool.from_config
    if source is None or source.config_map is None:
        return None
    return pool.namespace, source.config_map


def configured(pool: ModelPool, found: ModelConfig | None) -> ConfiguredModel | None:
    """The pool's layout from its config as the cluster holds it; None for a pool described by
    hand. Raises ConfigSourceError naming the field: `fromConfig.path`, which the cluster has no
    file for, the ConfigMap or its key, or the config's own field."""
    source = pool.from_config
    if source is None:
        return None
    if source.path is not None:
        raise ConfigSourceError(
            f"{FROM_CONFIG}.path",
            "names a file, and the operator reads none: in the cluster a model's config is a "
            "ConfigMap in the pool's namespace. Create one from config.json (kubectl create "
            "configmap NAME --from-file=config.json) and write fromConfig: {configMap: "
            "{name: NAME}} instead of path",
        )
    if found is None:  # the caller did not read it: a bug, not the user's to fix
        raise ConfigSourceError(f"{FROM_CONFIG}.configMap", "was not read from the cluster")
    if found.problem is not None:
        raise found.problem
    assert found.text is not None
    return resolve_text(pool, found.text, found.where)


@dataclass(frozen=True)
class KvGroupFigures:
    """One KV group of a configured pool, as its status shows it: the label, its kind, the
    model's layers in it, bytes of one page, its rule, and the worst-case request's pages."""

    name: str
    kind: str
    layers: int
    page_bytes: int
    rule: str
    worst_request_pages: int

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "layers": self.layers,
            "pageBytes": self.page_bytes,
            "rule": self.rule,
            "worstRequestPages": self.worst_request_pages,
        }


def group_figures(pool: ModelPool, model: ConfiguredModel) -> tuple[KvGroupFigures, ...]:
    """Per group, what `kvbank check` prints under a configured pool."""
    layout = model.pool
    _, worst = worst_case(layout.capacity_model(pool.limits.max_seq_len, pool.limits.max_tokens))
    return tuple(
        KvGroupFigures(
            group.label,
            group.kind.value,
            group.layers,
            layout.page_bytes,
            group.rule(),
            worst.per_label[group.label],
        )
        for group in layout.groups
    )


# ---- serving it ---------------------------------------------------------------------------------


def served_text(found: ModelConfig) -> str:
    """The config.json the ranks get, as judged: its JSON re-written with sorted keys, so that
    an edit that changes nothing the reader sees (spacing, key order) renders the same
    ConfigMap and rolls no pod. Called only on a config that `configured` read."""
    assert found.text is not None
    return json.dumps(parse_config_text(found.text, found.where), sort_keys=True) + "\n"


def served_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec the ranks read: its fromConfig pointing at the copy beside the manifest
    (path), with the same kvDtype and weightsGiB."""
    model = dict(spec["model"])
    architecture = dict(model["architecture"])
    source = {k: v for k, v in architecture["fromConfig"].items() if k != "configMap"}
    architecture["fromConfig"] = {**source, "path": MODEL_CONFIG_FILE}
    model["architecture"] = architecture
    return {**spec, "model": model}


def pinned(pool: ModelPool, model: ConfiguredModel, pages: int) -> ModelPool:
    """The pool as its ranks are started: the page count judged (a memory fraction is sized by
    the layout's page bytes, which the placeholder architecture does not know) and a label per
    KV group, so that what is rendered from the pool is what was judged."""
    kv = replace(pool.kv, pages=pages, memory_fraction=None)
    return replace(pool, kv=kv, kv_slots=model.pool.kv_slots)


# Flags of `vllm serve` that would change the layout judged: the operator renders them from
# the spec for a fromConfig pool.
VLLM_LAYOUT_FLAGS = {
    "--max-num-batched-tokens": "spec.limits.maxNumBatchedTokens",
    "--kv-cache-dtype": f"{FROM_CONFIG}.kvDtype",
    "--hf-config-path": f"{FROM_CONFIG}.configMap",
    "--hf-overrides": f"{FROM_CONFIG}.configMap",
}


def serving_refusals(model: ConfiguredModel, deployment: Deployment) -> tuple[str, ...]:
    """Why the pods a pool renders would not run the layout judged: kvbank's engine decodes
    one group of full attention, and a vLLM flag in spec.engine.args may change the layout."""
    if deployment.engine.kind != "vllm":
        groups = model.pool.groups
        if len(groups) == 1 and groups[0].kind is Kind.FULL:
            return ()
        described = ", ".join(f"{g.label} ({g.layers} layers)" for g in groups[:MAX_GROUPS])
        return (
            f"spec.engine.kind: kvbank's engine decodes one KV group of full attention, and "
            f"this model's config.json lays it out in {len(groups)} group(s) of "
            f"{', '.join(sorted({g.kind.value for g in groups}))} ({described}). Set "
            "spec.engine.kind: vllm to serve it.",
        )
    refusals = []
    for index, arg in enumerate(deployment.engine.args):
        flag = arg.split("=", 1)[0]
        if flag in VLLM_LAYOUT_FLAGS:
            refusals.append(
                f"spec.engine.args[{index}]: sets {flag}, which decides the KV layout judged "
                f"from the model's config.json; drop it and set {VLLM_LAYOUT_FLAGS[flag]}"
            )
    state = [g for g in model.pool.groups if g.kind.is_state]
    if state and NO_PREFIX_CACHING not in deployment.engine.args:
        described = ", ".join(f"{g.label} ({g.layers} layers)" for g in state[:MAX_GROUPS])
        refusals.append(
            f"spec.engine.args: this model keeps {state[0].kind.value} state ({described}), "
            f"which kvbank's scheduler counts as vLLM holds it without prefix caching (vLLM's "
            f"prefix caching keeps such state longer, and kvbank's scheduler class refuses it "
            f"at start-up); add {NO_PREFIX_CACHING} to spec.engine.args"
        )
    return tuple(refusals)


NO_PREFIX_CACHING = "--no-enable-prefix-caching"


MAX_GROUPS = 6  # named in a refusal; a config has at most a few
