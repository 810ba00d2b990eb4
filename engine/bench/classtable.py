"""The second table of `kvbank bench`, for scenarios with service classes, SLOs or a host tier:
goodput, TPOT, stalls, recomputation and host reloads per policy, preemptions and TPOT p99 per
class, then how each policy admitted each class."""

from __future__ import annotations

from typing import Any

from kvbank.engine.bench.scenario import Scenario, ServiceClass
from kvbank.engine.bench.simulate import RunResult

# (header, metric key, format)
CLASS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("goodput/s", "goodput_per_s", "{:.3f}"),
    ("TPOT p50", "tpot_p50_s", "{:.3f}s"),
    ("TPOT p99", "tpot_p99_s", "{:.3f}s"),
    ("max stall", "max_stall_s", "{:.2f}s"),
    ("recomputed", "recomputed_tokens", "{}"),
    ("host reloads", "host_pages_reloaded", "{}"),
)

CLASS_LEGEND = (
    ("goodput/s", "completed requests that met their class's SLO (all, without one), per second"),
    ("TPOT p50/p99", "time per output token after the first, per completed request"),
    ("max stall", "the longest wait between two tokens of one request"),
    ("recomputed", "positions whose KV was computed again after a preemption"),
    ("host reloads", "pages copied back from the host tier instead of recomputed"),
)


def has_classes(scenario: Scenario) -> bool:
    return bool(scenario.host_pages) or any(
        c.slo is not None or c.service_class is not ServiceClass.STRICT
        for c in scenario.workload.classes
    )


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_classes(results: list[RunResult]) -> list[str]:
    classes = sorted({c for r in results for c in r.metrics["preemptions_by_class"]})
    header = [name for name, _, _ in CLASS_COLUMNS]
    header += [f"preempt {c}" for c in classes] + [f"TPOT p99 {c}" for c in classes]
    rows = []
    for r in results:
        m = r.metrics
        row = [_cell(m[key], fmt) for _, key, fmt in CLASS_COLUMNS]
        row += [str(m["preemptions_by_class"].get(c, 0)) for c in classes]
        row += [_cell(m["tpot_by_class"].get(c, {}).get("p99_s"), "{:.3f}s") for c in classes]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    width = max(len(name) for name, _ in CLASS_LEGEND)
    lines += ["", *(f"{name.rjust(width)}  {meaning}" for name, meaning in CLASS_LEGEND)]
    groups: dict[str, list[str]] = {}  # how the classes were admitted -> policies
    for r in results:
        how = "; ".join(f"{c} {way}" for c, way in sorted(r.metrics["admitted_as"].items()))
        groups.setdefault(how, []).append(r.policy)
    notes = [f"admitted as, under {', '.join(names)}: {how}" for how, names in groups.items()]
    return [*lines, "", *notes]
