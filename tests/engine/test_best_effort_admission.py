"""What a best-effort admission leaves to the strict requests running beside it, with exact
pages. Page size 4, no speculative slot; a pool of 17 pages (16 usable). Strict `s` runs with an
8-token prompt and a 40-token budget: it holds 2 pages and has 12 reserved, 14 pages are free.
Until the pool has seen 20 lengths, a best-effort request is expected to write 70% of its
budget (the decaying ratio's start, engine/admission/estimate.py)."""

from __future__ import annotations

from engine_builders import finish, tiny_model

from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.request import Request, Status
from kvbank.service_class import ServiceClass

BE = ServiceClass.BEST_EFFORT


def _strict_running() -> tuple[Engine, Request]:
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=48)
    engine = Engine(EngineConfig(model, 17, "peak+backfill", 64), VirtualRunner())
    s = engine.add_request("s", list(range(1, 9)), 40)
    engine.step()
    assert (s.held, s.worst, engine.kv.free) == (2, 12, 14)
    return engine, s


def test_a_best_effort_request_uses_what_strict_ones_reserved_but_reach_only_later() -> None:
    engine, s = _strict_running()
    best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
    b = engine.add_request("b", list(range(100, 108)), 16, service_class=BE)
    # b is expected to write 12 tokens (5 pages with its prompt) in 12 steps; s writes 12
    # tokens in that time, 3 more pages with the one it is writing into: not its 10 reserved.
    assert (best_effort.expected_steps(b), best_effort.expected_pages(b)) == (12, 5)
    assert best_effort.strict_growth(12) == 4
    engine.step()
    assert b.status is Status.RUNNING  # 5 <= 14 - 4; counting s's whole reservation, 5 > 4
    finish(engine)
    assert (s.preemptions, b.preemptions, s.finish_reason, b.finish_reason) == (
        0,
        0,
        *["length"] * 2,
    )


def test_a_best_effort_request_expected_to_outlast_the_strict_growth_waits() -> None:
    engine, s = _strict_running()
    best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
    b = engine.add_request("b", list(range(100, 108)), 40, service_class=BE)
    # 28 tokens expected (9 pages): in 28 steps s may take 8 more, which leaves 14 - 8 = 6.
    assert (best_effort.expected_steps(b), best_effort.expected_pages(b)) == (28, 9)
    assert best_effort.strict_growth(28) == 8
    engine.step()
    assert b.status is Status.WAITING
    finish(engine)
    assert (s.preemptions, b.preemptions) == (0, 0)
    assert b.admitted_at > s.admitted_at
