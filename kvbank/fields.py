"""Reading typed fields out of nested mappings (parsed YAML or JSON) without raising: every
problem is kept as a `FieldError` naming the field, what was wrong and what to write instead, so a
user fixes a manifest in one pass. The ModelPool and CapacityPolicy readers share it."""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QUOTE_LIMIT = 80  # characters of a bad value an error message repeats
# What a manifest may hold: a ModelPool has a few dozen values a few levels deep. Whatever reads
# it (the webhook's JSON, a YAML file with aliases) is refused past these before it is walked.
MAX_DEPTH = 64
MAX_VALUES = 100_000


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr: a few items per container and a few levels, so quoting a value
    costs the same whatever its size (a YAML alias bomb expands to millions of items)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxother = QUOTE_LIMIT
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # past Python's 4,300-digit limit for int -> str
            return f"<an integer of {x.bit_length()} bits>"


_SHORT = _ShortRepr()


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)` cut to at most `limit` characters, at a cost bounded by `limit`, never by
    the value's size. Every error message that repeats a bad value quotes it with this."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: float) -> str:
    """A number in a message: %g for a float, and an int (which may be past float's range, or
    past int -> str's 4,300 digits) quoted at a bounded length."""
    return f"{value:g}" if isinstance(value, float) else quote(value)


# Kubernetes object names (k8s.io/apimachinery validation): a DNS-1123 label for a namespace;
# a ModelPool's name also becomes its Services' names, which must be DNS-1035 labels (a letter
# first).
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL_LENGTH = 63


def key_path(path: str, key: object) -> str:
    """`path.key` with the key cut short: a key is as much user input as a value."""
    name = key if isinstance(key, str) else quote(key)
    return f"{path}.{name if len(name) <= 63 else name[:60] + '...'}"


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """A manifest that cannot be read as a ModelPool; `errors` lists every problem."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def check_size(doc: object, path: str = "manifest") -> FieldError | None:
    """Why `doc` is too big or too deep to read (None: it is not), at a cost bounded by
    MAX_VALUES whatever `doc` holds: a value shared many times (a YAML alias) counts each time,
    as every reader that walks it would pay."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    values = 1
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            size = 2 * len(value)
        elif isinstance(value, list | tuple):
            size = len(value)
        else:
            continue
        if depth >= MAX_DEPTH:
            return FieldError(path, f"nests deeper than {MAX_DEPTH} levels; a manifest needs few")
        values += size
        if values > MAX_VALUES:
            return FieldError(
                path,
                f"holds more than {MAX_VALUES} values (a value an alias repeats counts each "
                f"time); a ModelPool holds a few dozen",
            )
        if isinstance(value, Mapping):
            stack.extend((child, depth + 1) for child in (*value.keys(), *value.values()))
        else:
            stack.extend((child, depth + 1) for child in value)
    return None


class FieldReader:
    """Reads typed fields out of nested mappings, recording a FieldError instead of raising."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def mapping(self, obj: Any, path: str, required: bool = True) -> Mapping[str, Any] | None:
        if obj is None:
            if required:
                self.fail(path, "is missing; add this section")
            return None
        if not isinstance(obj, Mapping):
            self.fail(path, f"must be a mapping, got {type(obj).__name__}")
            return None
        return obj

    def unknown(self, obj: Mapping[str, Any], path: str, known: set[str]) -> None:
        for key in obj:
            if key not in known:
                self.fail(
                    key_path(path, key), f"is not a known field; known: {', '.join(sorted(known))}"
                )

    def integer(
        self,
        obj: Mapping[str, Any],
        key: str,
        path: str,
        *,
        lo: int,
        hi: int,
        default: int | None = None,
    ) -> int | None:
        value = obj.get(key)
        if value is None:
            if default is None:
                self.fail(f"{path}.{key}", f"is missing; set an integer from {lo} to {hi}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                self.fail(
                    f"{path}.{key}", f"must be an integer from {lo} to {hi}, got {quote(value)}"
                )
                return None
        if not lo <= value <= hi:
            self.fail(f"{path}.{key}", f"must be from {lo} to {hi}, got {quote(value)}")
            return None
        return int(value)

    def number(
        self,
        obj: Mapping[str, Any],
        key: str,
        path: str,
        *,
        lo: float,
        hi: float,
        default: float | None = None,
        lo_open: bool = False,
    ) -> float | None:
        value = obj.get(key)
        if value is None:
            if default is None:
                self.fail(f"{path}.{key}", f"is missing; set a number from {lo:g} to {hi:g}")
            return default
        # math.isnan(int) converts to float first, which a 400-digit integer overflows.
        nan = isinstance(value, float) and math.isnan(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or nan:
            self.fail(
                f"{path}.{key}", f"must be a number from {lo:g} to {hi:g}, got {quote(value)}"
            )
            return None
        if value < lo or value > hi or (lo_open and value == lo):  # exact for any int
            bound = f"above {lo:g} and up" if lo_open else f"from {lo:g}"
            self.fail(f"{path}.{key}", f"must be {bound} to {hi:g}, got {_number(value)}")
            return None
        return float(value)

    def kube_name(self, obj: Mapping[str, Any], key: str, path: str, *, service: bool,
                  default: str | None = None) -> str | None:  # fmt: skip
        """A Kubernetes name: a DNS-1123 label, or with `service` a DNS-1035 label (a Service
        may be named after it)."""
        if default is not None and obj.get(key) in (None, ""):  # kubectl reads "" as unset
            return default
        value = self.string(obj, key, path)
        if value is None:
            return None
        rule, first = (
            (DNS_1035_LABEL, "a letter") if service else (DNS_1123_LABEL, "a letter or digit")
        )
        if len(value) > MAX_LABEL_LENGTH or not rule.fullmatch(value):
            self.fail(
                f"{path}.{key}",
                f"must be a Kubernetes name: at most {MAX_LABEL_LENGTH} lowercase letters, "
                f"digits and '-', starting with {first} and ending with a letter or digit, got "
                f"{quote(value)}",
            )
            return None
        return value

    def string(
        self,
        obj: Mapping[str, Any],
        key: str,
        path: str,
        *,
        required: bool = True,
        choices: tuple[str, ...] | None = None,
        default: str | None = None,
    ) -> str | None:
        value = obj.get(key)
        if value is None:
            if required:
                self.fail(f"{path}.{key}", "is missing")
            return default
        if not isinstance(value, str) or not value:
            self.fail(f"{path}.{key}", f"must be a non-empty string, got {quote(value)}")
            return None
        if choices is not None and value not in choices:
            self.fail(f"{path}.{key}", f"must be one of {', '.join(choices)}, got {quote(value)}")
            return None
        return value
