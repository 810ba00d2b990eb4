"""kvbank's scheduler class in vLLM's real v1 scheduler and KV cache manager (CPU, no model),
stepped synchronously (--no-async-scheduling) and as vLLM's async scheduling steps it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.structured_output import StructuredOutputManager
from vllm_builders import MODES, PAGE, _configs, bench, drive, scenario

from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.vllm_engine import FinishReason, vllm_configs
from kvbank.engine.bench.vllm_simulate import run_vllm_policy
from kvbank.ledger import client as client_module
from kvbank.vllm import KvbankScheduler
from kvbank.vllm import admission as admission_module
from kvbank.vllm import scheduler as scheduler_module
from kvbank.vllm.layout import UnsupportedLayout
from kvbank.vllm.scheduler import KvbankAsyncScheduler
from kvbank.vllm.settings import Settings, SettingsError
from kvbank.vllm.versions import SUPPORTED, UnsupportedVllm, check_vllm_version

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]

# Eight clients send one shared 20-page prompt into a 48-page pool: vLLM's own thrash.
SHARED = {
    "concurrency": 8,
    "requests": 16,
    "classes": [
        {
            "weight": 1,
            "prompt_tokens": 320,
            "shared_prefix": "system",
            "shared_prefix_tokens": 320,
            "max_tokens": 96,
            "output_tokens": 96,
        }
    ],
}


@pytest.mark.parametrize("mode", MODES)
def test_stock_vllm_preempts_on_a_shared_prefix_and_kvbank_admission_never_does(mode: str) -> None:
    case = scenario(48, **SHARED)
    stock = run_vllm_policy(case, "vllm", async_scheduling=MODES[mode]).metrics
    assert stock["preemptions"] > 0
    assert stock["completed"] == 16
    for policy in ("vllm+banker", "vllm+peak+backfill"):
        got = run_vllm_policy(case, policy, debug=True, async_scheduling=MODES[mode]).metrics
        assert got["preemptions"] == 0, policy
        assert (got["completed"], got["hung"], got["invariant_breaches"]) == (16, 0, 0), policy
        assert got["prefix_hit_rate"] > 0.5, policy  # the shared prompt is reused


def test_peak_fit_admits_more_at_once_than_the_conservative_ledger() -> None:
    case = scenario(48, **SHARED)
    banker = run_vllm_policy(case, "vllm+banker").metrics
    peak = run_vllm_policy(case, "vllm+peak+backfill").metrics
    assert peak["max_running"] >= banker["max_running"]
    assert peak["requests_per_s"] >= banker["requests_per_s"]


@pytest.mark.parametrize("mode", MODES)
def test_a_loose_pool_runs_exactly_as_stock_vllm(mode: str) -> None:
    case = scenario(4096, **{**SHARED, "requests": 24})
    stock = run_vllm_policy(case, "vllm", async_scheduling=MODES[mode]).metrics
    ours = run_vllm_policy(case, "vllm+peak+backfill", async_scheduling=MODES[mode]).metrics
    for key in ("completed", "duration_s", "steps", "max_running", "prefix_hit_rate"):
        assert ours[key] == stock[key], key


def test_vllm_resolves_the_class_by_the_name_vllm_serve_is_given() -> None:
    config = _configs(64, 512)[0].scheduler_config
    named = config.__class__(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=512,
        is_encoder_decoder=False,
        scheduler_cls="kvbank.vllm.KvbankScheduler",
    )
    assert named.get_scheduler_cls() is KvbankScheduler


def _kv_config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _construct(kv_cache_config: KVCacheConfig, vllm_config=None, settings=None) -> None:  # type: ignore[no-untyped-def]
    vllm_config = vllm_config or _configs(64, 512)[0]
    vllm_config.cache_config.num_gpu_blocks = 64
    KvbankScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=PAGE,
        settings=settings,
    )


def test_a_mamba_state_under_prefix_caching_is_refused_at_start_up_naming_the_flag() -> None:
    full = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    state = MambaSpec(
        block_size=PAGE, shapes=((1,),), dtypes=(torch.float32,),
        page_size_padded=full.page_size_bytes, mamba_cache_mode="align",
    )  # fmt: skip
    hybrid = [KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["mamba.0", "mamba.1"], state)]
    with pytest.raises(UnsupportedLayout) as refused:
        _construct(_kv_config(hybrid), settings=Settings())
    message = str(refused.value)
    assert "MambaSpec (2 layers, mamba_cache_mode align)" in message
    assert "--no-enable-prefix-caching" in message


def test_the_class_vllm_is_named_builds_the_variant_of_vllms_scheduling() -> None:
    for mode, async_scheduling in MODES.items():
        sched = bench(64, "peak+backfill", async_scheduling=async_scheduling).sched
        assert isinstance(sched, KvbankScheduler), mode
        assert isinstance(sched, AsyncScheduler) == async_scheduling, mode
        assert isinstance(sched, KvbankAsyncScheduler) == async_scheduling, mode


def test_the_async_variant_named_under_synchronous_scheduling_is_refused() -> None:
    vllm_config, kv_cache_config = _configs(64, 512)
    with pytest.raises(UnsupportedLayout, match="name kvbank.vllm.KvbankScheduler"):
        KvbankAsyncScheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=PAGE,
            settings=Settings(),
        )


def test_speculative_decoding_under_async_scheduling_is_refused_with_the_flags() -> None:
    vllm_config, kv_cache_config = vllm_configs(scenario(64), async_scheduling=True)
    vllm_config.speculative_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config,
    )
    with pytest.raises(UnsupportedLayout) as refused:
        _construct(kv_cache_config, vllm_config, Settings())
    assert "--no-async-scheduling" in str(refused.value)
    assert "--speculative-config" in str(refused.value)


def test_pipeline_parallelism_is_refused_with_the_flag() -> None:
    vllm_config, kv_cache_config = vllm_configs(scenario(64), async_scheduling=True)
    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(UnsupportedLayout, match="--pipeline-parallel-size 1"):
        _construct(kv_cache_config, vllm_config, Settings())


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.34.0rc1", "1.0.0", "nightly"])
def test_an_unsupported_vllm_is_refused_at_start_up_naming_the_range(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(scheduler_module, "installed_vllm_version", lambda: version)
    with pytest.raises(UnsupportedVllm) as refused:
        _construct(_configs(64, 512)[1], settings=Settings())
    assert SUPPORTED == ">=0.32.0,<0.34"
    assert SUPPORTED in str(refused.value)
    assert "0.32 and 0.33.x" in str(refused.value)


def test_the_supported_versions_and_their_builds_are_accepted() -> None:
    for version in ("0.32.0", "0.32.1", "0.33.0", "0.33.2", "0.33.1.dev4+g1234abc", "0.32.0+cpu"):
        check_vllm_version(version)
    check_vllm_version(scheduler_module.installed_vllm_version())  # the one installed here


def test_under_async_scheduling_a_decode_is_scheduled_before_its_token_is_known() -> None:
    """vLLM's async scheduling, as the bench steps it: the schedule after the first (nothing
    was output between them) schedules the first request's decode on a placeholder, and
    admits nothing, since the ledger has not heard what the first one allocated; the request
    that arrived between them is admitted at the next schedule."""
    run = bench(64, "peak+backfill", async_scheduling=True)
    sched = run.sched
    run.add("a", [3] * 40, 8, 8)
    run.step()  # a schedule, no output yet
    assert sched.requests["a"].num_output_placeholders == 1
    run.add("b", [4] * 40, 8, 8)
    run.step()  # the second schedule, then the first one's output
    assert sched.requests["a"].num_computed_tokens == 41  # its decode was scheduled
    assert "b" in sched.kvbank.waiting  # not admitted at that schedule
    run.step()
    assert "b" in sched.kvbank.admitted
    run.check_integrity()
    seen = drive(run, {})
    assert seen.preemptions == 0
    assert run.sched.kvbank.backend.ledger.outstanding == 0


def test_a_bad_policy_in_the_environment_is_refused_naming_the_variable(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVBANK_POLICY", "fastest")
    with pytest.raises(SettingsError) as refused:
        _construct(_configs(64, 512)[1])
    assert refused.value.variable == "KVBANK_POLICY"
    assert "peak+backfill" in str(refused.value)


@pytest.mark.parametrize("mode", MODES)
def test_a_request_the_pool_can_never_hold_finishes_with_the_reason(mode: str) -> None:
    run = bench(24, "peak+backfill", async_scheduling=MODES[mode])  # 23 usable pages: 368 tokens
    seen = drive(run, {0: [("huge", [5] * 400, 100, 100), ("small", [7] * 32, 8, 100)]})
    assert seen.finished == {"huge": FinishReason.ERROR, "small": FinishReason.LENGTH}
    assert not run.sched.requests


@pytest.mark.parametrize("mode", MODES)
def test_aborts_while_waiting_and_while_running_return_every_page(mode: str) -> None:
    run = bench(24, "banker", async_scheduling=MODES[mode])
    pool = run.sched.kv_cache_manager.block_pool
    prompt = [9] * 160  # 10 pages each: the second waits for the first
    arrivals = {
        0: [("a", prompt, 64, 64)],
        3: [("b", [*prompt, 1], 64, 64), ("c", [4] * 40, 8, 50)],
    }
    seen = drive(run, arrivals, aborts={5: ["b"], 8: ["a"]})
    assert seen.finished["a"] == seen.finished["b"] == FinishReason.ABORT
    assert seen.finished["c"] == FinishReason.LENGTH
    assert pool.get_num_free_blocks() == 23  # nothing pinned or reserved is left behind
    assert run.sched.kvbank.backend.ledger.outstanding == 0


def test_a_prefix_two_requests_share_within_one_schedule_is_not_counted_twice() -> None:
    """vLLM caches a prompt's full blocks as it allocates them, so the second of two requests
    with one uncached prefix, scheduled in the same step, hits the first one's blocks. Neither
    then returns those blocks alone when it finishes; the ledger must hear that before it
    promises pages on their return."""
    run = bench(48, "peak+backfill")
    prefix = [11] * 200  # 12 full pages
    run.add("a", [*prefix, 1], None, 3)
    run.add("b", [*prefix, 2], 2, 2)
    run.step()
    blocks = {rid: run.sched.kv_cache_manager.get_blocks(rid).blocks[0] for rid in ("a", "b")}
    shared = {b.block_id for b in blocks["a"]} & {b.block_id for b in blocks["b"]}
    assert len(shared) == 12  # vLLM shared them within the step
    tracks = run.sched.kvbank.backend.ledger.timeline.tracks
    for rid, table in blocks.items():
        assert tracks[rid].exclusive == sum(1 for b in table if b.ref_cnt == 1) == 1
    run.check_integrity()
    drive(run, {})  # to the end, checked every step
    assert run.sched.kvbank.backend.ledger.outstanding == 0


def test_requests_passed_over_unasked_change_no_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a refused head, a request the ledger refuses with any hit `_bound` allows is not
    looked up (`refuses_behind`): on vLLM's thrash mix the run is the run that asks every one,
    and every hit asked for is within its bound."""
    case = load_scenario(str(ROOT / "benchmarks" / "vllm-cpu-thrash.yaml"))
    passed_over = []
    refuses = client_module.EmbeddedClient.refuses_behind

    def counted(self: Any, rid: str, most_held: int, chunks: int | None) -> bool:
        refused = refuses(self, rid, most_held, chunks)
        passed_over.append(refused)
        return refused

    ask, bound = admission_module.Admission._ask, admission_module.Admission._bound

    def checked(self: Any, request: Any) -> tuple[Any, int | None]:
        hit, chunks = ask(self, request)
        most, bound_chunks = bound(self, request)
        assert hit is None or (hit.pages - hit.idle_pages <= most and chunks == bound_chunks)
        return hit, chunks

    monkeypatch.setattr(client_module.EmbeddedClient, "refuses_behind", counted)
    monkeypatch.setattr(admission_module.Admission, "_ask", checked)
    skipping = run_vllm_policy(case, "vllm+peak+backfill", debug=True).metrics
    assert sum(passed_over) > 100  # most requests behind a refused head, on a full pool
    monkeypatch.setattr(client_module.EmbeddedClient, "refuses_behind", lambda *a: False)
    asking = run_vllm_policy(case, "vllm+peak+backfill", debug=True).metrics
    for figures in (skipping, asking):
        figures.pop("wall_s", None)
    assert skipping == asking
