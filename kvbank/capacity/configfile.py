"""Reading a config.json as hostile input (a user's path, a ConfigMap anyone in the namespace
may edit): a size and depth bound, no NaN, and typed, ranged fields whose every problem is one
`ModelConfigError` naming the field, never a traceback."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvbank.fields import check_size, quote

_C = TypeVar("_C", str, int)  # what a per-layer list may hold

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; 1 MiB leaves room and bounds the read
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_DIM = 65536
MAX_WINDOW = 1 << 24


class ModelConfigError(ValueError):
    """A config.json kvbank cannot read; `field` is the config key it is about."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def load_config(path: str | Path) -> Mapping[str, Any]:
    """Read a config.json with its bounds: at most MAX_CONFIG_BYTES, a JSON object, no NaN or
    Infinity, no deeper than a manifest may be."""
    where = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ModelConfigError(
            "config.json", f"cannot read {quote(where)}: {exc.strerror}"
        ) from None
    return parse_config_text(data, where)


def parse_config_text(data: bytes | str, where: str = "config.json") -> Mapping[str, Any]:
    size = len(data)
    if size > MAX_CONFIG_BYTES:
        raise ModelConfigError(
            "config.json",
            f"{quote(where)} is over {MAX_CONFIG_BYTES} bytes; a model's config is a few KiB "
            f"(give the model's config.json, not its weights or tokenizer)",
        )

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        doc = json.loads(data, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelConfigError(
            "config.json", f"{quote(where)} is not valid JSON: {text[:120]}"
        ) from None
    too_big = check_size(doc, "config.json")
    if too_big is not None:
        raise ModelConfigError(too_big.path, too_big.message)
    if not isinstance(doc, dict):
        raise ModelConfigError("config.json", f"must be a JSON object, got {type(doc).__name__}")
    return doc


class ConfigFields:
    """Typed reads out of one config mapping; `prefix` names nested sections (text_config)."""

    def __init__(self, doc: Mapping[str, Any], prefix: str = ""):
        self.doc = doc
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.doc.get(key) is not None

    def integer(self, key: str, lo: int, hi: int, default: int | None = None) -> int:
        value = self.doc.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(self.name(key), f"is missing; it must be {lo} to {hi}")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(
                self.name(key), f"must be an integer from {lo} to {hi}, got {quote(value)}"
            )
        if not lo <= value <= hi:
            raise ModelConfigError(self.name(key), f"must be from {lo} to {hi}, got {value}")
        return value

    def number(self, key: str, lo: float, hi: float, default: float) -> float:
        value = self.doc.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ModelConfigError(self.name(key), f"must be a number, got {quote(value)}")
        if not lo <= value <= hi:
            raise ModelConfigError(self.name(key), f"must be from {lo:g} to {hi:g}, got {value}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.doc.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(self.name(key), f"must be true or false, got {quote(value)}")
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.doc.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ModelConfigError(self.name(key), f"must be a string, got {quote(value)}")
        return value

    def per_layer(self, key: str, length: int, choices: tuple[_C, ...]) -> list[_C] | None:
        """A list with one entry per layer, each one of `choices` (a bool is never one)."""
        value = self.doc.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != length:
            got = f"{len(value)} entries" if isinstance(value, list) else quote(value)
            raise ModelConfigError(self.name(key), f"must list {length} layers, got {got}")
        for index, item in enumerate(value):
            if isinstance(item, bool) or item not in choices:
                raise ModelConfigError(
                    f"{self.name(key)}[{index}]",
                    f"must be one of {', '.join(map(str, choices))}, got {quote(item)}",
                )
        return list(value)

    def section(self, key: str) -> ConfigFields | None:
        value = self.doc.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ModelConfigError(self.name(key), f"must be an object, got {quote(value)}")
        return ConfigFields(value, f"{self.name(key)}.")
