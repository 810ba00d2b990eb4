"""/metrics by service class: preemptions and recomputed positions, counted by the serve layer
from what the engine shows, on the virtual runner through the real scheduler and cache."""

from __future__ import annotations

from engine_builders import make_engine, tiny_model

from kvbank.engine.bench.outcomes import Outcome, RowObserver
from kvbank.engine.bench.scenario import RequestClass, Span
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.service_class import ServiceClass

STRICT, BEST_EFFORT = ServiceClass.STRICT, ServiceClass.BEST_EFFORT


def test_preemptions_and_recomputed_positions_are_counted_under_each_requests_class() -> None:
    # The preempt baseline ignores classes (as vLLM would): it admits on the prompt and, when
    # decode runs short, preempts the newest request whatever its class.
    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=40)
    engine, runner = make_engine(24, "preempt", model)
    metrics = ServeMetrics(24)
    metrics.meter_recompute(engine)
    cls = RequestClass("any", 1.0, Span(20, 20), Span(40, 40), 40)
    outcomes = {f"r{i}": Outcome(cls, engine, 0.0) for i in range(6)}  # type: ignore[arg-type]
    engine.runner = RowObserver(engine.runner, outcomes)  # an independent count of the rows
    requests = []
    for i in range(6):
        asked = BEST_EFFORT if i % 2 else STRICT
        requests.append(engine.add_request(f"r{i}", [7, *range(30 * i, 30 * i + 19)], 40,
                                           service_class=asked))  # fmt: skip
        runner.stop_after(f"r{i}", 40)
    while engine.has_work():
        metrics.observe_step(engine, engine.step())
    sample = metrics.registry.get_sample_value
    assert engine.sched.stats.preemptions > 0
    for service_class in ServiceClass:
        preempted = sum(r.preemptions for r in requests if r.service_class is service_class)
        label = {"service_class": service_class.value}
        assert sample("kvbank_preemptions_total", label) == preempted
    assert sample("kvbank_preemptions_total", {"service_class": "best-effort"}) > 0
    assert sample("kvbank_preemptions_total", {"service_class": "strict"}) > 0
    recomputed = {c: sample("kvbank_recomputed_tokens_total", {"service_class": c.value})
                  for c in ServiceClass}  # fmt: skip
    by_rid = {r.rid: r.service_class for r in requests}
    expected = {c: sum(o.recomputed for rid, o in outcomes.items() if by_rid[rid] is c)
                for c in ServiceClass}  # fmt: skip
    assert recomputed == expected
    assert recomputed[BEST_EFFORT] > 0


def test_every_class_series_exists_from_the_start() -> None:
    metrics = ServeMetrics(24)
    sample = metrics.registry.get_sample_value
    for name in ("kvbank_preemptions_total", "kvbank_recomputed_tokens_total",
                 "kvbank_class_requests_total"):  # fmt: skip
        for service_class in ("strict", "best-effort"):
            assert sample(name, {"service_class": service_class}) == 0
    for direction in ("to-host", "to-device"):
        assert sample("kvbank_host_pages_moved_total", {"direction": direction}) == 0
