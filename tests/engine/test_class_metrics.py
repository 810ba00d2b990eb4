"""/metrics by service class: preemptions and recomputed positions, counted by the serve layer
from what the engine shows, on the virtual runner through the real scheduler and cache."""

from __future__ import annotations

from collections.abc import Callable

from engine_builders import make_engine, tiny_model

from kvbank.engine.bench.outcomes import Outcome, RowObserver
from kvbank.engine.bench.scenario import RequestClass, Span
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.request import Request
from kvbank.engine.serve.http.metrics import ServeMetrics
from kvbank.service_class import ServiceClass

STRICT, BEST_EFFORT = ServiceClass.STRICT, ServiceClass.BEST_EFFORT
ANY = RequestClass("any", 1.0, Span(1, 1), Span(1, 1), 16)


Track = Callable[[Request], Request]


def metered(
    engine: Engine, add: Callable[[Engine, Track], list[Request]]
) -> tuple[dict, dict, dict]:
    """Run to the end under the serve metrics; returns, by class, the preemptions /metrics
    counted, the recomputed positions it counted, and the bench's own count of the rows."""
    metrics = ServeMetrics(engine.config.total_pages)
    metrics.meter_recompute(engine)
    outcomes: dict[str, Outcome] = {}
    engine.runner = RowObserver(engine.runner, outcomes)  # an independent count of the rows

    def track(req: Request) -> Request:  # before its first row, so every row is seen
        outcomes[req.rid] = Outcome(ANY, req, 0.0)
        return req

    requests = add(engine, track)
    while engine.has_work():
        metrics.observe_step(engine, engine.step())
    sample = metrics.registry.get_sample_value
    for cls in ServiceClass:  # /metrics agrees with the requests' own counts
        preempted = sum(r.preemptions for r in requests if r.service_class is cls)
        assert sample("kvbank_preemptions_total", {"service_class": cls.value}) == preempted
    counted = {c: sample("kvbank_preemptions_total", {"service_class": c.value})
               for c in ServiceClass}  # fmt: skip
    recomputed = {c: sample("kvbank_recomputed_tokens_total", {"service_class": c.value})
                  for c in ServiceClass}  # fmt: skip
    by_rid = {r.rid: r.service_class for r in requests}
    rows = {c: sum(o.recomputed for rid, o in outcomes.items() if by_rid[rid] is c)
            for c in ServiceClass}  # fmt: skip
    return counted, recomputed, rows


def test_a_strict_start_preempting_best_effort_is_counted_under_best_effort() -> None:
    # Two best-effort requests run; a strict one arrives needing more than is free, so the
    # peak-fit policy preempts a best-effort one (the pool's victim rule), which resumes later.
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=16)
    engine = Engine(EngineConfig(model, 21, "peak+backfill", 64), VirtualRunner())

    def add(engine: Engine, track: Track) -> list[Request]:
        a = track(engine.add_request("a", list(range(1, 9)), 8, service_class=BEST_EFFORT))
        b = track(engine.add_request("b", list(range(20, 42)), 8, service_class=BEST_EFFORT))
        engine.step()
        engine.step()
        s = track(engine.add_request("s", list(range(100, 148)), 4))
        return [a, b, s]

    counted, recomputed, rows = metered(engine, add)
    assert counted == {STRICT: 0, BEST_EFFORT: 1}
    assert recomputed == rows and recomputed[STRICT] == 0 and recomputed[BEST_EFFORT] > 0


def test_a_baseline_that_ignores_classes_preempts_strict_requests_and_is_counted_so() -> None:
    # The preempt baseline admits on the prompt and, when decode runs short, preempts the
    # newest request; it honours no class, so every request runs strict.
    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=40)
    engine, runner = make_engine(24, "preempt", model)

    def add(engine: Engine, track: Track) -> list[Request]:
        added = []
        for i in range(6):
            asked = BEST_EFFORT if i % 2 else STRICT
            prompt = [7, *range(30 * i, 30 * i + 19)]
            added.append(track(engine.add_request(f"r{i}", prompt, 40, service_class=asked)))
            runner.stop_after(f"r{i}", 40)
        return added

    counted, recomputed, rows = metered(engine, add)
    assert counted[STRICT] > 0 and counted[BEST_EFFORT] == 0
    assert recomputed == rows and recomputed[STRICT] > 0


def test_every_class_series_exists_from_the_start() -> None:
    metrics = ServeMetrics(24)
    sample = metrics.registry.get_sample_value
    for name in ("kvbank_preemptions_total", "kvbank_recomputed_tokens_total",
                 "kvbank_class_requests_total"):  # fmt: skip
        for service_class in ("strict", "best-effort"):
            assert sample(name, {"service_class": service_class}) == 0
    for direction in ("to-host", "to-device"):
        assert sample("kvbank_host_pages_moved_total", {"direction": direction}) == 0
