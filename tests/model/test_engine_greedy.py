"""Greedy output through the real engine (scheduler, KV manager, banker ledger, torch runner)
does not depend on the prefix cache, on chunked prefill, or on what else is in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbank.capacity import CapacityModel
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.model.loader import load_model
from kvbank.engine.model.runner import TorchRunner
from kvbank.modelpool import KvSlot

PAGE_SIZE = 4
MODEL = CapacityModel({"kv": KvSlot(prompt=1, output=1)}, PAGE_SIZE, 256, 64)
SHARED = [0, *range(200, 223)]  # 24 tokens: six full pages
PROMPTS = {f"r{i}": [*SHARED[: 5 + 3 * i], 300 + i, 7, 9 + i] for i in range(8)}


@pytest.fixture(scope="module")
def runner(builtin_model_dir: Path) -> TorchRunner:
    model = load_model(builtin_model_dir, torch.device("cpu"))
    return TorchRunner(model, num_pages=400, page_size=PAGE_SIZE, eos_token_id=1)


def _engine(runner: TorchRunner, max_batch_tokens: int = 2048) -> Engine:
    config = EngineConfig(MODEL, 400, max_batch_tokens=max_batch_tokens, debug=True)
    return Engine(config, runner)


def _drain(engine: Engine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    return outputs


def _run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_tokens)
    return _drain(engine)


def test_batch_of_8_equals_8_requests_alone(runner: TorchRunner) -> None:
    together = _run(_engine(runner), PROMPTS, 10)
    alone: dict[str, list[int]] = {}
    for rid, prompt in PROMPTS.items():
        alone.update(_run(_engine(runner), {rid: prompt}, 10))
    assert together == alone
    assert len({tuple(v) for v in alone.values()}) > 1


def test_chunked_prefill_equals_whole_prefill(runner: TorchRunner) -> None:
    whole = _run(_engine(runner), PROMPTS, 8)
    engine = _engine(runner, max_batch_tokens=7)  # every prompt is cut into chunks
    chunked = _run(engine, PROMPTS, 8)
    assert chunked == whole


def test_prefix_cache_hit_equals_cold_prefill(runner: TorchRunner) -> None:
    warm = _engine(runner)
    _run(warm, {"first": [*SHARED, 1000, 5]}, 4)
    prompt = [*SHARED, 17, 18, 19]
    hot = _run(warm, {"second": prompt}, 12)
    assert warm.sched.stats.hit_tokens == len(SHARED)  # six pages came from the cache
    cold = _run(_engine(runner), {"second": prompt}, 12)
    assert hot == cold
