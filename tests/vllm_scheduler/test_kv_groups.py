"""Several KV cache groups in vLLM's real scheduler under kvbank's admission (CPU, no model):
sliding window beside full attention, chunked local attention, a Mamba state (vLLM's mode
"none"), a model of sliding windows only, and MLA. Under random workloads on small
pools: vLLM never preempts what kvbank admitted, at every step each request's blocks in each
group stay within what the capacity function counted for that group (windows freeing blocks as
they go), the ledger stays safe against vLLM's free blocks, and at the end every page is back.
Layouts kvbank cannot count are refused at start-up, naming the group."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.structured_output import StructuredOutputManager
from vllm_builders import drive

from kvbank.capacity import RequestShape, count_pages
from kvbank.engine.bench.scenario import Scenario, parse_scenario
from kvbank.engine.bench.vllm_engine import FinishReason, VllmBench, vllm_configs
from kvbank.engine.bench.vllm_simulate import run_vllm_policy
from kvbank.vllm import KvbankScheduler
from kvbank.vllm.layout import UnsupportedLayout
from kvbank.vllm.scheduler import make_backend
from kvbank.vllm.settings import Settings

pytestmark = pytest.mark.timeout(900)
PAGE = 16
BATCH = 64  # a small step budget, so a window's cap (window + one step) binds
FULL = {"prompt": 1, "output": 1}
LAYOUTS: dict[str, dict[str, Any]] = {
    "sliding+full": {"full": FULL, "swa": {**FULL, "sliding_window": 40}},
    "chunked+full": {"full": FULL, "local": {**FULL, "attention_chunk": 48}},
    "mamba+full": {"full": FULL, "state": {"fixed": PAGE}},  # mode none
    "sliding-only": {"swa": {**FULL, "sliding_window": 24}},
    "sliding+mamba+full": {
        "full": FULL,
        "swa": {**FULL, "sliding_window": 40},
        "state": {"fixed": PAGE},
    },
}
PREFIX = [11] * 96  # a shared system prompt, 6 pages


def scenario(layout: str, pages: int, max_seq_len: int = 512) -> Scenario:
    return parse_scenario(
        {
            "name": layout,
            "pool": {"pages": pages, "page_size": PAGE},
            "model": {
                "kv_slots": LAYOUTS[layout],
                "max_seq_len": max_seq_len,
                "max_tokens_default": 160,
            },
            "workload": {
                "concurrency": 4,
                "requests": 4,
                "seed": 1,
                "classes": [
                    {"weight": 1, "prompt_tokens": 64, "max_tokens": 32, "output_tokens": 32}
                ],
            },
        }
    )


@functools.lru_cache(maxsize=16)
def _configs(layout: str, pages: int) -> tuple[Any, Any]:
    return vllm_configs(scenario(layout, pages), max_batch_tokens=BATCH)


def bench(layout: str, pages: int, policy: str | None, backend: Any = None) -> VllmBench:
    vllm_config, kv_cache_config = _configs(layout, pages)
    vllm_config.cache_config.num_gpu_blocks = pages
    chosen = Settings(policy) if policy is not None else None
    return VllmBench(scenario(layout, pages), chosen, backend, (vllm_config, kv_cache_config))


class GroupWatch:
    """After every step, each admitted request's blocks per group (vLLM's own tables, null
    blocks left out) against count_pages for that request, label by label."""

    def __init__(self, run: VllmBench) -> None:
        self.run = run
        self.highest: dict[str, int] = {}  # per label, the most blocks any request held there
        self.freed_by_window = False

    def __call__(self) -> None:
        sched = self.run.sched
        admission = sched.kvbank
        labels = list(admission.model.kv_slots)
        for rid, entry in admission.admitted.items():
            request = entry.request
            if request.request_id not in sched.requests or entry.pin:
                continue
            count = count_pages(
                admission.model, RequestShape(request.num_prompt_tokens, request.max_tokens)
            )
            blocks = sched.kv_cache_manager.get_blocks(rid).blocks
            for label, group in zip(labels, blocks, strict=True):
                held = sum(1 for b in group if not b.is_null)
                assert held <= count.per_label[label], (rid, label, held, count.per_label)
                self.highest[label] = max(self.highest.get(label, 0), held)
                if any(b.is_null for b in group):
                    self.freed_by_window = True


request = st.tuples(
    st.booleans(),  # starts with the shared prefix
    st.integers(1, 200),  # own prompt tokens
    st.one_of(st.none(), st.integers(1, 200)),  # max_tokens (None: the server's default)
    st.integers(1, 240),  # where the model would stop
    st.integers(0, 30),  # arrival step
    st.one_of(st.none(), st.integers(0, 60)),  # abort step, if its client goes away
)


def _run(  # type: ignore[no-untyped-def]
    layout: str, pages: int, policy: str, requests: list, backend=None, pause_s: float = 0.0
) -> GroupWatch:
    run = bench(layout, pages, policy, backend)
    watch = GroupWatch(run)
    arrivals: dict[int, list] = {}  # type: ignore[type-arg]
    aborts: dict[int, list[str]] = {}
    for i, (shared, own, max_tokens, output, at, abort) in enumerate(requests):
        prompt = (PREFIX if shared else []) + [100 + i] * own
        arrivals.setdefault(at, []).append((f"r{i}", prompt, max_tokens, output))
        if abort is not None:
            aborts.setdefault(at + abort, []).append(f"r{i}")
    steps = 20000 if not pause_s else 60000
    seen = drive(run, arrivals, aborts, max_steps=steps, pause_s=pause_s, on_step=watch)
    assert seen.preemptions == 0
    assert run.sched.kvbank.preemptions == 0
    assert set(seen.finished) == {f"r{i}" for i in range(len(requests))}
    for rid, reason in seen.finished.items():
        if reason == FinishReason.ERROR:  # refused as never holdable, before it ran
            assert seen.tokens.get(rid, 0) == 0
    assert not run.sched.requests
    assert run.sched.kv_cache_manager.block_pool.get_num_free_blocks() == pages - 1
    assert run.sched.kvbank.backend.outstanding() == 0
    return watch


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pages=st.integers(24, 72),
    policy=st.sampled_from(["banker", "peak+backfill", "peak", "banker+backfill"]),
    requests=st.lists(request, min_size=1, max_size=12),
)
def test_random_workloads_on_several_groups_never_preempt_and_stay_within_each_groups_count(
    layout: str, pages: int, policy: str, requests: list
) -> None:
    _run(layout, pages, policy, requests)


_sessions = iter(range(1 << 30))


@pytest.mark.parametrize("blocking", [True, False], ids=["waits", "never-waits"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request, min_size=1, max_size=10))
def test_a_hybrid_pool_over_a_real_sidecar(sidecar: str, blocking: bool, requests: list) -> None:
    """Sliding window and full attention over the sidecar, waited on and not (the head's whole
    hit pinned until the decision arrives)."""
    chosen = Settings("peak+backfill", sidecar, token="vllm-property", blocking=blocking)
    lookahead = 0
    backend = make_backend(chosen, 48, PAGE, lookahead, engine_id=f"groups-{next(_sessions)}")
    _run("sliding+full", 48, "peak+backfill", requests, backend, 0 if blocking else 0.001)
    assert backend.sessions_opened <= 1  # none re-opened (none when all left before a report)


@pytest.mark.parametrize("policy", ["banker", "peak+backfill"])
def test_a_window_dropping_a_block_another_request_shares_costs_it_a_page(policy: str) -> None:
    """Two requests on one cached prefix: the longer one's window drops the shared blocks
    while the shorter still holds them, which frees no page; found by the property above."""
    requests = [(True, 97, None, 1, 0, None), (True, 1, None, 1, 0, None)]
    _run("sliding+full", 48, policy, [(False, 1, None, 1, 0, None)] * 4 + requests)


@pytest.mark.parametrize("layout", ["sliding+full", "chunked+full", "sliding-only"])
def test_a_window_frees_blocks_as_it_runs_and_the_ledger_counts_them(layout: str) -> None:
    """Long requests past the window: vLLM nulls what fell out of it, never holds more than
    the window's cap, and the pages come back whole at the end."""
    requests = [(True, 300, 120, 120, i, None) for i in range(6)]
    watch = _run(layout, 48, "peak+backfill", requests)
    assert watch.freed_by_window
    model = bench(layout, 48, "banker").sched.kvbank.model
    window = next(label for label in model.kv_slots if label not in ("g0-full",))
    assert watch.highest[window] <= model.label_caps[window] < 30  # far below every position


def test_stock_vllm_thrashes_a_hybrid_pool_and_kvbank_never_preempts() -> None:
    body = {
        "name": "hybrid-thrash",
        # The bench's step budget is 2048 tokens, so a window holds up to every position here:
        # 33 + 33 pages a request, one at a time fits
        "pool": {"pages": 96, "page_size": PAGE},
        "model": {"kv_slots": LAYOUTS["sliding+full"], "max_seq_len": 1024},
        "workload": {
            "concurrency": 8,
            "requests": 16,
            "seed": 3,
            "classes": [
                {
                    "weight": 1,
                    "prompt_tokens": 320,
                    "shared_prefix": "system",
                    "shared_prefix_tokens": 256,
                    "max_tokens": 200,
                    "output_tokens": 200,
                },
            ],
        },
    }
    case = parse_scenario(body)
    stock = run_vllm_policy(case, "vllm").metrics
    assert stock["preemptions"] > 0
    for policy in ("vllm+banker", "vllm+peak+backfill"):
        got = run_vllm_policy(case, policy, debug=True).metrics
        assert got["preemptions"] == 0, policy
        assert (got["completed"], got["hung"], got["invariant_breaches"]) == (16, 0, 0), policy


def _construct(groups: list[KVCacheGroupSpec]) -> None:
    vllm_config = _configs("sliding+full", 64)[0]
    KvbankScheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=PAGE,
        settings=Settings(),
    )


def test_mla_is_counted_as_every_position() -> None:
    mla = MLAAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    _construct([KVCacheGroupSpec(["mla.0", "mla.1"], mla)])


def test_a_group_kvbank_cannot_count_is_refused_at_start_up_naming_it() -> None:
    full = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cross = CrossAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["cross.0"], cross)]
    with pytest.raises(UnsupportedLayout) as refused:
        _construct(groups)
    message = str(refused.value)
    assert "CrossAttentionSpec (1 layers)" in message
    assert "--scheduler-cls kvbank.vllm.KvbankScheduler" in message
    other = FullAttentionSpec(block_size=2 * PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    with pytest.raises(UnsupportedLayout, match="different tokens per block"):
        _construct([KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["full.1"], other)])
