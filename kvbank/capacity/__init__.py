"""Capacity, its one public face: `from kvbank.capacity import count_pages, ...`.

The operator's webhook, `kvbank check`, the sidecar's ledger and the engine all call
`count_pages` (`count`), so what `kubectl apply` accepts is exactly what the runtime can admit.
Everything else here (the worst-case request, the holdability rules in `holdability`, the
per-request refusal in `refusal`) is derived by calling it, never by repeating its arithmetic.
"""

from kvbank.capacity.count import (
    SINK_PAGES,
    CapacityModel,
    LabelGrowth,
    LabelTerms,
    PageCount,
    RequestShape,
    count_pages,
    group_tokens,
    label_growth,
    label_terms,
    largest_fitting,
    output_budget,
    pages_for,
    pages_for_labels,
    shared_prompt_pages,
    usable_pages,
    worst_case,
)
from kvbank.capacity.holdability import (
    GIB,
    Holdability,
    describe_worst,
    holdability,
    kv_heads_per_rank,
    memory_budget_bytes,
    page_bytes,
    pool_pages,
    weight_bytes_per_rank,
)
from kvbank.capacity.refusal import Refusal, refusal, refusal_message

__all__ = [
    "GIB",
    "SINK_PAGES",
    "CapacityModel",
    "Holdability",
    "LabelGrowth",
    "LabelTerms",
    "PageCount",
    "Refusal",
    "RequestShape",
    "count_pages",
    "describe_worst",
    "group_tokens",
    "holdability",
    "kv_heads_per_rank",
    "label_growth",
    "label_terms",
    "largest_fitting",
    "memory_budget_bytes",
    "output_budget",
    "page_bytes",
    "pages_for",
    "pages_for_labels",
    "pool_pages",
    "refusal",
    "refusal_message",
    "shared_prompt_pages",
    "usable_pages",
    "weight_bytes_per_rank",
    "worst_case",
]
