"""vLLM's real v1 scheduler and KV cache manager for `kvbank bench --engine vllm`, with no model.

Built as vLLM's own scheduler tests build one (a VllmConfig, a KVCacheConfig, no GPU:
VLLM_TARGET_DEVICE=cpu), from a model directory holding only a small Llama config.json. Each of
the scenario's KV labels is one KV cache group (`kv_cache_groups`): full attention, a sliding
window or an attention chunk where the label sets one, and a Mamba state for a label of fixed
tokens only. Prefix caching is on (off with a Mamba state, which kvbank counts in vLLM's mode
"none" only), chunked prefill on, async scheduling off (the bench steps synchronously, as vLLM
does with --no-async-scheduling) unless asked for. The pool is the scenario's: vLLM's null
block is kvbank's sink page, so both have `pages - 1` usable pages.

`VllmBench.step()` is one engine step: vLLM schedules, the bench supplies the sampled tokens
(the workload's output lengths, as kvbank's virtual runner does) and the step time from the
scenario's cost model, and vLLM processes the result into its own outputs. Under async
scheduling a step is stepped as vLLM's engine core steps its batch queue of two: schedule the
next step, then process the output of the one before it (the first schedule after an idle
engine is followed by a second before any output).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU needed: vLLM's CPU platform
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU-platform notices are not ours

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvbank.engine.bench.scenario import Scenario
from kvbank.engine.bench.virtual import EOS_TOKEN_ID, VOCAB
from kvbank.vllm.settings import Settings

__all__ = ["FinishReason", "VllmBench", "build_scheduler", "kv_cache_groups", "vllm_configs"]

MAX_BATCH_TOKENS = 2048  # kvbank's EngineConfig defaults, so both engines batch alike
MAX_RUNNING = 256


def model_dir(max_model_len: int) -> Path:
    """A local model directory vLLM's ModelConfig reads: a small Llama config, no weights."""
    path = Path(tempfile.gettempdir()) / f"kvbank-vllm-bench-llama-{max_model_len}"
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": EOS_TOKEN_ID,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def has_state(scenario: Scenario) -> bool:
    """Whether a label is a Mamba state (fixed tokens only): vLLM then runs without prefix
    caching, its mode "none"."""
    return any(
        (slot.prompt, slot.output) == (0, 0) and slot.fixed
        for slot in scenario.model.kv_slots.values()
    )


def kv_cache_groups(scenario: Scenario) -> list[KVCacheGroupSpec]:
    """One KV cache group per label of the scenario, in its order, every page of one size (a
    block of one float32 K and V head per token), as vLLM's hybrid allocator pools them."""
    model = scenario.model
    page = model.page_size
    common: dict[str, Any] = dict(block_size=page, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page_bytes = FullAttentionSpec(**common).page_size_bytes
    groups = []
    for i, (label, slot) in enumerate(model.kv_slots.items()):
        window = scenario.kv_windows.get(label)
        spec: KVCacheSpec
        if (slot.prompt, slot.output) == (0, 0):
            spec = MambaSpec(
                block_size=model.max_seq_len,  # without prefix caching: one block a request
                shapes=((1,),),
                dtypes=(torch.float32,),
                page_size_padded=page_bytes,
                mamba_cache_mode="none",
                num_speculative_blocks=model.speculative_tokens,
            )
        elif window is None:
            spec = FullAttentionSpec(**common)
        elif window[0] == "sliding_window":
            spec = SlidingWindowSpec(**common, sliding_window=window[1])
        else:
            spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=window[1])
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.{label}"], spec))
    return groups


def vllm_configs(
    scenario: Scenario,
    async_scheduling: bool = False,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
    scheduling_policy: str = "fcfs",
) -> tuple[Any, Any]:
    """vLLM's engine config and the KV cache groups of the scenario's pool; `scheduling_policy`
    is vllm serve's --scheduling-policy (fcfs or priority)."""
    model = scenario.model
    max_len = model.max_seq_len
    model_config = ModelConfig(
        model=str(model_dir(max_len)),
        skip_tokenizer_init=True,
        max_model_len=max_len,
        dtype="float32",
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=min(MAX_RUNNING, max_batch_tokens),
        max_num_batched_tokens=max_batch_tokens,
        max_model_len=max_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        policy=scheduling_policy,
    )
    cache_config = CacheConfig(
        block_size=model.page_size, enable_prefix_caching=not has_state(scenario)
    )
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
    )
    # vLLM's CPU platform turns async scheduling off whatever it is asked; with no model run
    # here the scheduler is stepped as a GPU's engine core steps it, so the setting is restored.
    scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=scenario.pages, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups(scenario)
    )
    cache_config.num_gpu_blocks = scenario.pages
    return vllm_config, kv_cache_config


def build_scheduler(
    scenario: Scenario, settings: Settings | None, backend: Any = None, configs: Any = None
) -> Any:
    """Stock vLLM (`settings` None: its `Scheduler`, or `AsyncScheduler` under async scheduling)
    or vLLM with kvbank's scheduler class; `configs` replaces `vllm_configs(scenario)`."""
    vllm_config, kv_cache_config = configs or vllm_configs(scenario)
    # vLLM schedules in blocks of every group's size (a Mamba state's, without prefix
    # caching, is max_model_len tokens) and hashes prompts by the page
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    args: dict[str, Any] = dict(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=math.lcm(scenario.model.page_size, *sizes),
        hash_block_size=scenario.model.page_size,
        log_stats=False,
    )
    if settings is None:
        if vllm_config.scheduler_config.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            return AsyncScheduler(**args)
        return Scheduler(**args)
    from kvbank.vllm.scheduler import KvbankScheduler

    return KvbankScheduler(**args, settings=settings, backend=backend)


@dataclass
class StepTotals:
    """What one step did, for the cost model and the metrics."""

    seconds: float = 0.0
    scheduled: int = 0  # requests given tokens
    unscheduled_running: int = 0  # running requests given none (budget or pages)
    preempted: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (rid, first position, count)
    admitted_tokens: int = 0  # prompt positions of requests scheduled for the first time
    hit_tokens: int = 0  # of which the prefix cache covered
    outputs: list[Any] = field(default_factory=list)  # vLLM's EngineCoreOutput


class VllmBench:
    """One vLLM scheduler on the virtual clock."""

    def __init__(
        self,
        scenario: Scenario,
        settings: Settings | None,
        backend: Any = None,
        configs: Any = None,
        async_scheduling: bool = False,
    ) -> None:
        """`configs` replaces `vllm_configs(scenario, async_scheduling)`."""
        self.scenario = scenario
        configs = configs or vllm_configs(scenario, async_scheduling)
        self.sched = build_scheduler(scenario, settings, backend, configs)
        hash_fn = get_hash_fn_by_name(self.sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(scenario.model.page_size, hash_fn)
        self._stop_after: dict[str, int] = {}
        self._bases: dict[str, int] = {}
        self.steps = 0
        self.async_scheduling = bool(self.sched.scheduler_config.async_scheduling)
        # Async scheduling: the scheduled steps whose output is not processed yet, newest first.
        self._in_flight: deque[tuple[Any, Any]] = deque()

    @property
    def usable_pages(self) -> int:
        return self.sched.kv_cache_manager.block_pool.num_gpu_blocks - 1

    @property
    def held_pages(self) -> int:
        return self.usable_pages - self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int | None,
        output_tokens: int,
        tier: str | None = None,
        priority: int = 0,
    ) -> None:
        """A client's request. With no max_tokens the server's default applies, as vLLM's
        frontend fills it in (`--generation-config`'s max_new_tokens, here the scenario's
        max_tokens_default), capped by max_model_len. `tier`: the `service_tier` a client sends
        in `vllm_xargs` (flex: best-effort); `priority`: vLLM's request priority."""
        model = self.scenario.model
        budget = model.max_tokens if max_tokens is None else max_tokens
        budget = max(1, min(budget, model.max_seq_len - len(prompt)))
        extra = {"service_tier": tier} if tier is not None else None
        params = SamplingParams(max_tokens=budget, stop_token_ids=[EOS_TOKEN_ID], extra_args=extra)
        request = Request(
            rid, list(prompt), params, None, arrival_time=float(self.steps),
            block_hasher=self._hasher, priority=priority,
        )  # fmt: skip
        self._stop_after[rid] = output_tokens
        self._bases[rid] = zlib.crc32(f"{self.scenario.workload.seed}:{rid}".encode())
        self.sched.add_request(request)

    def has_work(self) -> bool:
        return self.sched.has_requests() or bool(self._in_flight)

    def step(self) -> StepTotals:
        if not self.async_scheduling:
            totals, out, runner_output = self._schedule()
            self._process(totals, out, runner_output)
            return totals
        sched = self.sched
        totals = StepTotals()
        if sched.has_requests():
            totals, out, runner_output = self._schedule()
            self._in_flight.appendleft((out, runner_output))
            if len(self._in_flight) < 2 and (
                out.total_num_scheduled_tokens or sched.has_requests()
            ):
                return totals  # vLLM's engine core: the queue is not full, schedule again first
        elif not self._in_flight:
            return totals
        out, runner_output = self._in_flight.pop()
        self._process(totals, out, runner_output)
        return totals

    def _schedule(self) -> tuple[StepTotals, Any, Any]:
        """vLLM schedules a step; the model's sampled tokens for it, known now (they depend only
        on the request and the token's index)."""
        sched, cost = self.sched, self.scenario.cost
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        self.steps += 1
        totals = StepTotals(
            preempted=len(out.preempted_req_ids), preempted_ids=sorted(out.preempted_req_ids)
        )
        for new in out.scheduled_new_reqs:
            totals.admitted_tokens += len(new.prompt_token_ids or ())
            totals.hit_tokens += new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid in cached.resumed_req_ids:  # readmitted after a preemption: recomputed
                totals.admitted_tokens += sched.requests[rid].num_tokens
                totals.hit_tokens += computed
        prefill = decode = pages = 0
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, count in out.num_scheduled_tokens.items():
            request = sched.requests[rid]
            # schedule() has advanced num_computed_tokens past this step's positions
            totals.rows.append((rid, request.num_computed_tokens - count, count))
            samples = request.num_computed_tokens >= request.num_tokens
            if count == 1 and samples and before.get(rid, 0) > 0:
                decode += 1
            else:
                prefill += count
            pages += sum(
                1
                for group in sched.kv_cache_manager.get_blocks(rid).blocks
                for block in group
                if not block.is_null
            )
            req_ids.append(rid)
            # Under async scheduling the token this row samples is the last placeholder.
            index = request.num_output_tokens + max(1, request.num_output_placeholders)
            sampled.append([self._next_token(rid, index)] if samples else [])
        totals.scheduled = len(req_ids)
        totals.unscheduled_running = sum(
            1 for r in sched.running if r.request_id not in out.num_scheduled_tokens
        )
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        totals.seconds = (
            cost.step_seconds(prefill, decode, pages) if req_ids else cost.step_base_ms / 1000
        )
        return totals, out, runner_output

    def _process(self, totals: StepTotals, out: Any, runner_output: Any) -> None:
        """vLLM processes a step's output into its own; `totals` gets them."""
        engine_outputs = self.sched.update_from_output(out, runner_output)
        for outputs in engine_outputs.values():
            totals.outputs.extend(outputs.outputs)
        for output in totals.outputs:
            if output.finish_reason is not None:
                self._stop_after.pop(output.request_id, None)
                self._bases.pop(output.request_id, None)

    def _next_token(self, rid: str, index: int) -> int:
        """The `index`-th output token (1-based): the stop token at the workload's output
        length, otherwise a pure function of (seed, request, index)."""
        if index >= self._stop_after.get(rid, 1 << 62):
            return EOS_TOKEN_ID
        return 2 + (self._bases.get(rid, 0) + index * 2654435761) % (VOCAB - 2)

    def check_integrity(self) -> None:
        admission = getattr(self.sched, "kvbank", None)
        if admission is not None:
            admission.check_integrity()

    @property
    def stalled_steps(self) -> int:
        admission = getattr(self.sched, "kvbank", None)
        return admission.stalled_steps if admission is not None else 0
