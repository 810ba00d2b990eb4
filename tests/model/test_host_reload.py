"""Greedy output through the real engine and torch runner does not change when a request is
preempted and its prompt comes back from the host tier instead of being recomputed: the pages
copied out and back are the very KV the request wrote. On CUDA the host tensors are pinned and
the copies asynchronous (the `gpu` case, skipped without a GPU)."""

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
PROMPTS = {f"r{i}": [0, *range(100 + 40 * i, 100 + 40 * i + 22 + i)] for i in range(6)}
MAX_TOKENS = 24
SMALL_POOL = 30  # too small for six requests' growth: the preempting baseline preempts


def _devices() -> list[object]:
    gpu = pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    )
    return ["cpu", gpu]


def _drain(engine: Engine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    return outputs


def _run(
    model_dir: Path, device: str, pages: int, host_pages: int
) -> tuple[dict[str, list[int]], Engine]:
    model = load_model(model_dir, torch.device(device))
    runner = TorchRunner(model, pages, PAGE_SIZE, eos_token_id=-1, host_pages=host_pages)
    config = EngineConfig(MODEL, pages, policy="preempt", host_pages=host_pages, debug=True)
    engine = Engine(config, runner)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, MAX_TOKENS)
    return _drain(engine), engine


@pytest.mark.parametrize("device", _devices())
def test_greedy_output_after_preempt_and_reload_equals_the_uninterrupted_run(
    builtin_model_dir: Path, device: str
) -> None:
    alone, roomy = _run(builtin_model_dir, device, pages=400, host_pages=0)
    assert roomy.sched.stats.preemptions == 0
    reloaded, engine = _run(builtin_model_dir, device, pages=SMALL_POOL, host_pages=64)
    host = engine.kv.host
    assert engine.sched.stats.preemptions > 0
    assert host is not None and host.saved > 0 and host.loaded > 0
    assert reloaded == alone
    assert all(len(tokens) == MAX_TOKENS for tokens in alone.values())
    assert len({tuple(tokens) for tokens in alone.values()}) > 1


def test_a_runner_without_a_host_tier_refuses_a_step_that_moves_pages(
    builtin_model_dir: Path,
) -> None:
    from kvbank.engine.kv.host import Direction, HostMove
    from kvbank.engine.runner import StepBatch

    model = load_model(builtin_model_dir, torch.device("cpu"))
    runner = TorchRunner(model, 8, PAGE_SIZE, eos_token_id=-1)
    with pytest.raises(ValueError, match="build it with host_pages"):
        runner.forward(StepBatch(3, [], [HostMove(Direction.TO_HOST, 1, 0)]))
    hosted = TorchRunner(model, 8, PAGE_SIZE, eos_token_id=-1, host_pages=2)
    with pytest.raises(ValueError, match="host slot 2 is outside this host tier of 2 pages"):
        hosted.forward(StepBatch(3, [], [HostMove(Direction.TO_HOST, 1, 2)]))
