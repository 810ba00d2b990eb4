"""Whether a ModelPool can hold what its spec promises: GPU memory per rank and the holdability
rules the operator's webhook and `kvbank check` apply, each derived from `count_pages`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvbank.capacity.count import (
    SINK_PAGES,
    CapacityModel,
    PageCount,
    RequestShape,
    largest_fitting,
    usable_pages,
    worst_case,
)
from kvbank.modelpool import ModelPool

if TYPE_CHECKING:
    from kvbank.capacity.configured import ConfiguredModel

GIB = 1 << 30


# ---- GPU memory ---------------------------------------------------------------------------------


def kv_heads_per_rank(pool: ModelPool) -> int:
    """KV heads one rank stores: split when TP divides them, replicated when TP exceeds them."""
    return max(1, pool.architecture.kv_heads // pool.tensor_parallel)


def page_bytes(pool: ModelPool) -> int:
    arch = pool.architecture
    return (
        2
        * arch.layers
        * kv_heads_per_rank(pool)
        * arch.head_dim
        * arch.dtype_bytes
        * pool.kv.page_size
    )


def weight_bytes_per_rank(pool: ModelPool) -> float:
    arch = pool.architecture
    return arch.parameters * arch.dtype_bytes / pool.tensor_parallel


def memory_budget_bytes(pool: ModelPool) -> float:
    return pool.gpu.memory_gib * pool.gpu.memory_utilization * GIB


def pool_pages(pool: ModelPool, configured: ConfiguredModel | None = None) -> int:
    """Pages per rank: the spec's count, or its fraction of what weights and reserve leave
    (`configured`: the pool's layout from its config.json, whose page bytes and weights count)."""
    if pool.kv.pages is not None:
        return pool.kv.pages
    weights = (
        weight_bytes_per_rank(pool) if configured is None else configured.weights_bytes_per_rank
    )
    bytes_per_page = page_bytes(pool) if configured is None else configured.pool.page_bytes
    left = memory_budget_bytes(pool) - weights - pool.gpu.reserved_gib * GIB
    fraction = pool.kv.memory_fraction or 0.0
    return max(0, int(left * fraction // bytes_per_page))


# ---- Holdability --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holdability:
    pages: int
    worst_request_pages: int
    worst_concurrency: int  # worst-case requests the pool holds at once (conservative reading)
    violations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def _worst_fits(model: CapacityModel, usable: int, **changes: int) -> bool:
    changed = replace(model, **changes)  # type: ignore[arg-type]
    if changed.max_tokens >= changed.max_seq_len:
        changed = replace(changed, max_tokens=changed.max_seq_len - 1)
    return worst_case(changed)[1].total <= usable


def describe_worst(model: CapacityModel, shape: RequestShape, count: PageCount) -> str:
    spec = model.speculative_tokens
    spec_part = f" + {spec} speculative token{'s' if spec != 1 else ''}" if spec else ""
    if len(count.per_label) == 1 and all(
        s.prompt == 1 and s.output == 1 and s.fixed == 0 for s in model.kv_slots.values()
    ):
        return (
            f"{count.total} pages: maxSeqLen {model.max_seq_len}{spec_part} at pageSize "
            f"{model.page_size}"
        )
    # sorted: the apiserver hands the webhook kvSlots in key order, and both must print alike
    labels = ", ".join(f"{label} {pages}" for label, pages in sorted(count.per_label.items()))
    return (
        f"{count.total} pages: a {shape.prompt_tokens}-token prompt with "
        f"{count.output_tokens} output tokens{spec_part} at pageSize {model.page_size}; "
        f"per label {labels}"
    )


def holdability(pool: ModelPool, configured: ConfiguredModel | None = None) -> Holdability:
    """Every reason the pool could not hold what the spec promises, each with the numbers and
    what to change. An empty tuple means the spec is holdable. `configured`: the layout of a
    pool whose architecture is `fromConfig`, resolved by the caller (it reads a file); each of
    its KV groups is a label with its own rule, and its page bytes and weights count."""
    if pool.from_config is not None and configured is None:
        return Holdability(0, 0, 0, (
            "model.architecture.fromConfig is not resolved here: this reader does not load "
            "config files. Run kvbank check on the manifest beside its config.json, or give "
            "the architecture by hand.",
        ))  # fmt: skip
    if configured is None:
        model = CapacityModel.from_pool(pool)
        bytes_per_page = page_bytes(pool)
        weights = weight_bytes_per_rank(pool)
    else:
        model = configured.pool.capacity_model(pool.limits.max_seq_len, pool.limits.max_tokens)
        bytes_per_page = configured.pool.page_bytes
        weights = configured.weights_bytes_per_rank
    pages = pool_pages(pool, configured)
    usable = usable_pages(pages)
    shape, worst = worst_case(model)
    problems: list[str] = []

    if worst.total > usable:
        fixes = [f"Raise kv.pages to at least {worst.total + SINK_PAGES}"]
        seq = largest_fitting(
            2, model.max_seq_len - 1, lambda n: _worst_fits(model, usable, max_seq_len=n)
        )
        if seq is not None:
            fixes.append(f"lower limits.maxSeqLen to at most {seq}")
        out = largest_fitting(
            1, model.max_tokens - 1, lambda n: _worst_fits(model, usable, max_tokens=n)
        )
        if out is not None and any(s.output > s.prompt for s in model.kv_slots.values()):
            fixes.append(f"lower limits.maxTokens to at most {out}")
        where = "kv.pages" if pool.kv.pages is not None else "the pool sized by kv.memoryFraction"
        problems.append(
            f"{where}={pages} cannot hold one worst-case request "
            f"({describe_worst(model, shape, worst)}). {', or '.join(fixes)}."
        )

    concurrency = usable // worst.total if worst.total else 0
    need = pool.admission.min_concurrency
    if need and concurrency < need and worst.total <= usable:
        problems.append(
            f"admission.minConcurrency={need} needs {need * worst.total + SINK_PAGES} pages "
            f"({need} x {worst.total} per worst-case request + {SINK_PAGES} sink page) but "
            f"kv.pages={pages} holds {concurrency}. Raise kv.pages to at least "
            f"{need * worst.total + SINK_PAGES}, or lower admission.minConcurrency to "
            f"{concurrency}."
        )

    arch, tp = pool.architecture, pool.tensor_parallel
    if configured is not None and configured.pool.page_size != pool.kv.page_size:
        layout = configured.pool
        problems.append(
            f"kv.pageSize={pool.kv.page_size} is below what one page of this model's state "
            f"needs: vLLM raises its block size to {layout.page_size} tokens so that a "
            f"{layout.layer_page_bytes}-byte page holds it. Set kv.pageSize to "
            f"{layout.page_size}."
        )
    # A configured layout checked its heads against tensorParallel when it was made.
    if configured is None and arch.attention_heads % tp:
        problems.append(
            f"tensorParallel={tp} does not divide model.architecture.attentionHeads="
            f"{arch.attention_heads}. Use a tensorParallel that divides it "
            f"({', '.join(str(d) for d in _divisors(arch.attention_heads) if d <= 64)})."
        )
    if configured is None and arch.kv_heads % tp and tp % arch.kv_heads:
        problems.append(
            f"tensorParallel={tp} cannot split model.architecture.kvHeads={arch.kv_heads}: "
            f"one must divide the other. Use tensorParallel "
            f"{' or '.join(str(d) for d in _divisors(arch.kv_heads))}, or a multiple of "
            f"{arch.kv_heads}."
        )

    budget = memory_budget_bytes(pool)
    kv_bytes = pages * bytes_per_page
    reserve = pool.gpu.reserved_gib * GIB
    if kv_bytes + weights + reserve > budget:
        room = int((budget - weights - reserve) // bytes_per_page)
        fix = (
            f"Lower kv.pages to at most {room}"
            if room > 0
            else f"Raise tensorParallel above {tp} or use a larger GPU"
        )
        problems.append(
            f"pool + weights + reserve need {_gib(kv_bytes + weights + reserve)} GiB per rank "
            f"(kv {_gib(kv_bytes)} GiB for {pages} pages of {bytes_per_page} bytes, weights "
            f"{_gib(weights)} GiB, reserved {_gib(reserve)} GiB) but gpu.memoryGiB="
            f"{pool.gpu.memory_gib:g} x memoryUtilization={pool.gpu.memory_utilization:g} "
            f"gives {_gib(budget)} GiB. {fix}, or raise gpu.memoryGiB."
        )
    if pool.kv.pages is None and pages < 2:
        problems.append(
            f"kv.memoryFraction={pool.kv.memory_fraction:g} leaves {pages} pages after weights "
            f"and reserve. Raise kv.memoryFraction or gpu.memoryGiB."
        )
    return Holdability(pages, worst.total, concurrency, tuple(problems))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"
