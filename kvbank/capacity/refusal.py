"""Per-request refusal: why the pool can never hold a request, with the numbers and the request
parameter to change, derived from `count_pages`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbank.capacity.count import (
    SINK_PAGES,
    CapacityModel,
    PageCount,
    RequestShape,
    count_pages,
    largest_fitting,
    usable_pages,
)


@dataclass(frozen=True)
class Refusal:
    """A request the pool can never hold. `param` is the request parameter to change: `n` when
    fewer sequences fit (`n_fit`, the most that do), else `max_tokens` when a lower one fits
    (`max_tokens_fit`, the largest that does), else `prompt`. The HTTP layer names
    `max_tokens` as the client did (`max_completion_tokens`, say)."""

    param: str
    pages: int  # the request's worst case
    usable_pages: int  # pages the pool holds for requests
    pool_pages_needed: int  # the smallest pool that holds it
    max_tokens_fit: int | None
    message: str
    n_fit: int | None = None


def refusal_message(pages: int, usable: int, advice: str, detail: str = "") -> str:
    """The one wording of a pool refusal (the engine's at ingest, the ledger's at submit)."""
    return (
        f"this request needs {pages} KV pages{detail} but the pool holds {usable} pages for "
        f"requests; {advice}"
    )


def refusal(
    model: CapacityModel,
    request: RequestShape,
    pool_pages_total: int,
    count: PageCount | None = None,
) -> Refusal | None:
    """None when the pool can ever hold this request, else why not and what to change (the
    message of the HTTP 400). `count`: count_pages's result for this request, when the caller
    has it."""
    usable = usable_pages(pool_pages_total)
    count = count_pages(model, request) if count is None else count
    if count.total <= usable:
        return None
    needed = count.total + SINK_PAGES
    advice = [f"raise the pool to at least {needed} pages"]
    budget = count.output_tokens
    best = None
    if budget > 1:
        best = largest_fitting(
            1,
            budget,
            lambda n: count_pages(model, _with_max_tokens(request, n)).total <= usable,
        )
        if best is not None:
            advice.insert(0, f"lower max_tokens to at most {best}")
    sequences = request.sequences
    fewer = None
    if sequences > 1:
        fewer = largest_fitting(
            1,
            sequences - 1,
            lambda n: count_pages(model, replace(request, sequences=n)).total <= usable,
        )
        if fewer is not None:
            advice.insert(0, f"lower n to at most {fewer}")
    if len(advice) == 1:
        advice.insert(0, "shorten the prompt")
    group = f"{sequences} sequences of " if sequences > 1 else ""
    detail = (
        f" ({group}{request.prompt_tokens} prompt tokens + {count.output_tokens} max_tokens + "
        f"{model.speculative_tokens} speculative at page size {model.page_size})"
    )
    message = refusal_message(count.total, usable, ", or ".join(advice), detail)
    param = "n" if fewer is not None else "prompt" if best is None else "max_tokens"
    return Refusal(param, count.total, usable, needed, best, message, fewer)


def _with_max_tokens(request: RequestShape, max_tokens: int) -> RequestShape:
    return replace(request, max_tokens=max_tokens)
