"""A ModelPool whose architecture comes from the model's config.json (`fromConfig`): the model's
layout, the pool vLLM would make of it on one rank, and its weights per rank, resolved once so
that `holdability`, `kvbank check` and `kvbank plan` judge the same figures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvbank.capacity.hfconfig import (
    ModelConfigError,
    ModelLayout,
    model_layout,
    parse_config_text,
    read_layout,
)
from kvbank.capacity.layout import EngineSettings, LayoutError, PoolLayout, pool_layout
from kvbank.modelpool import ModelPool


@dataclass(frozen=True)
class ConfiguredModel:
    model: ModelLayout
    pool: PoolLayout
    weights_bytes_per_rank: float


def configure(
    model: ModelLayout, settings: EngineSettings, weights_bytes: float | None = None
) -> ConfiguredModel:
    """The pool of `model` under `settings`; weights default to the config's estimate, split
    evenly over the ranks."""
    total = model.weight_bytes() if weights_bytes is None else weights_bytes
    return ConfiguredModel(model, pool_layout(model, settings), total / settings.tensor_parallel)


def settings_of(pool: ModelPool) -> EngineSettings:
    return EngineSettings(
        page_size=pool.kv.page_size,
        tensor_parallel=pool.tensor_parallel,
        kv_dtype=pool.from_config.kv_dtype if pool.from_config else "bfloat16",
        max_num_batched_tokens=pool.limits.max_num_batched_tokens,
        speculative_tokens=pool.kv.speculative_tokens,
    )


class ConfigSourceError(ValueError):
    """fromConfig could not be resolved; `field` is the manifest or config field to fix."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


FROM_CONFIG = "spec.model.architecture.fromConfig"


def resolve(pool: ModelPool, base: Path) -> ConfiguredModel | None:
    """The configured model of a pool that names `fromConfig.path` (relative to `base`, the
    manifest's folder); None for a pool described by hand. Raises ConfigSourceError naming the
    field: the manifest's, or the config's under `fromConfig`."""
    source = pool.from_config
    if source is None:
        return None
    if source.path is None:
        raise ConfigSourceError(
            f"{FROM_CONFIG}.configMap",
            "is read by the operator from the cluster; kvbank check reads only a local path "
            "(fromConfig: {path: config.json})",
        )
    path = Path(source.path)
    if not path.is_absolute():
        path = base / path
    return _configured(pool, lambda: read_layout(path), FROM_CONFIG)


def resolve_beside(pool: ModelPool, manifest: str) -> ConfiguredModel | None:
    """`resolve` for the manifest file `manifest` ('-': stdin, so the working folder): how
    `kvbank check`, `kvbank sidecar --pool` and `kvbank serve --pool` all find a pool's
    config.json, so the three judge one file alike. The operator writes the config it judged
    beside the manifest it renders for the ranks, which is how they find the same one."""
    if pool.from_config is None:
        return None
    return resolve(pool, Path.cwd() if manifest == "-" else Path(manifest).resolve().parent)


def resolve_text(pool: ModelPool, data: bytes | str, where: str) -> ConfiguredModel:
    """The configured model of a pool from its config.json's text, as the operator reads it out
    of the ConfigMap its `fromConfig.configMap` names (`where` names that copy in messages).
    The same bounds as a file: ConfigSourceError names the config's field under
    `fromConfig.configMap`, or the manifest's."""
    field = f"{FROM_CONFIG}.configMap"
    return _configured(pool, lambda: model_layout(parse_config_text(data, where)), field)


def _configured(pool: ModelPool, read: Callable[[], ModelLayout], field: str) -> ConfiguredModel:
    source = pool.from_config
    assert source is not None
    try:
        layout = read()
        weights = source.weights_gib * (1 << 30) if source.weights_gib is not None else None
        return configure(layout, settings_of(pool), weights)
    except ModelConfigError as exc:
        raise ConfigSourceError(f"{field} {exc.field}", exc.message) from None
    except LayoutError as exc:
        raise ConfigSourceError(f"spec.{exc.field}", exc.message) from None
