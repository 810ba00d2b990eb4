"""Small builders for the engine tests: a tiny model, a request, an engine on the virtual
runner, and a loop that drives it to the end with integrity checks after every step."""

from __future__ import annotations

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig, RequestOutput
from kvbank.engine.request import Request
from kvbank.engine.request import make_request as _make_request
from kvbank.ledger.client import LedgerClient
from kvbank.modelpool import KvSlot

TEXT = {"main": KvSlot(prompt=1, output=1)}


def tiny_model(
    page_size: int = 4,
    max_seq_len: int = 64,
    max_tokens: int = 16,
    speculative: int = 0,
    slots: dict[str, KvSlot] | None = None,
) -> CapacityModel:
    return CapacityModel(slots or TEXT, page_size, max_seq_len, max_tokens, speculative)


def make_request(
    rid: str, prompt: list[int], max_tokens: int | None = 4, model: CapacityModel | None = None
) -> Request:
    return _make_request(model or tiny_model(), rid, prompt, max_tokens)


def make_engine(
    pages: int,
    policy: str = "banker",
    model: CapacityModel | None = None,
    backend: LedgerClient | None = None,
    **config: int,
) -> tuple[Engine, VirtualRunner]:
    runner = VirtualRunner()
    engine = Engine(
        EngineConfig(model or tiny_model(), pages, policy=policy, debug=True, **config),
        runner,
        backend,
    )
    return engine, runner


def drain(engine: Engine, max_steps: int = 5000) -> tuple[dict[str, RequestOutput], int]:
    """Step until idle; returns each request's final output and the most requests that ran at
    once. Debug mode checks integrity after every step."""
    finished: dict[str, RequestOutput] = {}
    most_running = 0
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            if out.finished:
                finished[out.rid] = out
        most_running = max(most_running, engine.num_running)
    return finished, most_running


def finish(engine: Engine, max_steps: int = 500) -> None:
    """Step until idle, checking the pool's integrity deeply after every step; fails when work
    is left after `max_steps`."""
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
        engine.check_integrity(deep=True)
    raise AssertionError(f"work left after {max_steps} steps")
