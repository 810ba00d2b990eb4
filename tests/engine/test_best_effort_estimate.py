"""What a best-effort admission expects a request to reach: the decaying ratio until the
learned estimate has `min_samples` lengths of the class, the learned lengths after."""

from __future__ import annotations

from engine_builders import tiny_model

from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass

BE = ServiceClass.BEST_EFFORT


def _engine(estimate: Estimate) -> Engine:
    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=40)
    config = EngineConfig(model, 64, "peak+backfill", 64, classes=ClassPolicy(estimate=estimate))
    return Engine(config, VirtualRunner())


def test_the_learned_estimate_answers_with_the_ratio_until_it_has_lengths() -> None:
    engine = _engine(Estimate.LEARNED)
    req = engine.add_request("a", list(range(8)), 40, service_class=BE)
    best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
    # 8 prompt tokens + ceil(0.7 * 40) = 28 output tokens: 36 positions, 9 pages.
    assert best_effort.expected_pages(req) == 9
    for _ in range(best_effort.estimator.min_samples - 1):
        best_effort.estimator.observe(BE.value, 4)
    assert best_effort.expected_pages(req) == 9  # one length short: still the ratio
    best_effort.estimator.observe(BE.value, 4)
    assert best_effort.expected_pages(req) == 3  # 8 + 4 tokens: 3 pages


def test_the_ratio_estimate_is_the_ratio_throughout() -> None:
    engine = _engine(Estimate.RATIO)
    req = engine.add_request("a", list(range(8)), 40, service_class=BE)
    best_effort = engine.policy.best_effort  # type: ignore[attr-defined]
    for _ in range(30):
        best_effort.estimator.observe(BE.value, 4)
    assert best_effort.expected_pages(req) == 9
