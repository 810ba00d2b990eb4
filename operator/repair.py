"""Drift repair: what an accepted pool renders is read back on a timer and applied again where it
is missing or differs, so a deleted StatefulSet or Service comes back and a hand-edited replica
count is set back — reconcile alone runs only when the pool itself changes.

Comparison is of what the operator sets, not of whole objects: the apiserver adds defaults
(a container's terminationMessagePath, a Service's clusterIP) and other controllers add their
own fields (`kubectl rollout restart`'s annotation), none of which is drift. A rendered field is
drifted when the live object lacks it or holds another value; quantities compare by value, so
the apiserver writing `1` for `1.0` or `1Gi` for `1024Mi` is not drift either.

That comparison is cheap (one read per object) but cannot know every way the apiserver
rewrites what it is sent (a field a disabled feature gate drops, say), so what it calls drift
is confirmed by a dry-run apply before anything is applied: only if the object as the
apiserver would store it differs from the live one is the apply real.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

SUFFIXES: dict[str, Decimal | int] = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def quantity(value: Any) -> Decimal | None:
    match = QUANTITY.match(str(value))
    if match is None:
        return None
    try:
        return Decimal(match.group(1)) * SUFFIXES[match.group(2) or ""]
    except InvalidOperation:
        return None


def _same_leaf(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, bool) or isinstance(have, bool):
        return False
    if isinstance(want, int | float | str) and isinstance(have, int | float | str):
        a, b = quantity(want), quantity(have)
        return a is not None and a == b
    return False


def drift(want: Any, have: Any, path: str = "") -> list[str]:
    """The paths where `have` does not hold what `want` sets (at most a few, for the log)."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return [path or "."]
        found: list[str] = []
        for key, value in want.items():
            found += drift(value, have.get(key), f"{path}.{key}")
        return found
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return [path]
        found = []
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            found += drift(w, h, f"{path}[{i}]")
        return found
    return [] if _same_leaf(want, have) else [path]


def compared(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a rendered manifest that are the operator's to keep: its labels, its
    annotations and owner, and everything under spec (or data)."""
    meta = manifest.get("metadata") or {}
    kept: dict[str, Any] = {"metadata": {"labels": meta.get("labels") or {}}}
    if meta.get("annotations"):
        kept["metadata"]["annotations"] = meta["annotations"]
    for key in ("spec", "data", "type"):
        if key in manifest:
            kept[key] = manifest[key]
    return kept


def stored_differs(stored: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether applying would change `live`: `stored` is the apiserver's answer to a dry-run
    apply of the rendered manifest (the live object with the operator's fields laid over it,
    defaulted and canonicalised as the apiserver stores them)."""

    def kept(obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        return {
            "labels": meta.get("labels") or {},
            "annotations": meta.get("annotations") or {},
            **{k: obj.get(k) for k in ("spec", "data", "type")},
        }

    return kept(stored) != kept(live)


def why_repair(manifest: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """None when `live` holds what `manifest` renders, else why it must be applied again."""
    if live is None:
        return "missing"
    paths = drift(compared(manifest), live)
    if not paths:
        return None
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f"drifted at {shown}"
