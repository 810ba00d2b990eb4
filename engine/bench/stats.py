"""The figures every engine's bench run reports of the requests it served, drawn the same way
for kvbank's engine, vLLM's scheduler and each replica of a cluster run."""

from __future__ import annotations

import math
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q`th percentile, rounded for the table (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return round(ordered[rank], 4)


def served_metrics(
    requests: int,
    counts: dict[str, int],
    duration_s: float,
    ttft: dict[str, list[float]],
    e2e: list[float],
    util_area: float,
) -> dict[str, Any]:
    """What every engine's run reports of the requests it served, in the bench's field order:
    `counts` has completed, rejected and failed; `ttft` is by class."""
    done = counts["completed"]
    all_ttft = [v for values in ttft.values() for v in values]
    return {
        "completed": done,
        "hung": requests - done - counts["rejected"] - counts["failed"],
        "rejected": counts["rejected"],
        "failed": counts["failed"],
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(done / duration_s, 4) if duration_s else 0.0,
        "ttft_p50_s": percentile(all_ttft, 50),
        "ttft_p99_s": percentile(all_ttft, 99),
        "ttft_by_class": {
            name: {"p50_s": percentile(v, 50), "p99_s": percentile(v, 99)}
            for name, v in sorted(ttft.items())
        },
        "e2e_p50_s": percentile(e2e, 50),
        "kv_utilisation": round(util_area / duration_s, 4) if duration_s else 0.0,
    }
