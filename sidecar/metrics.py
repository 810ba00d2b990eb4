"""The sidecar's Prometheus metrics, on a registry of their own (one per server, so tests can run
several in one process).

Pool gauges are read from the ledger when Prometheus scrapes, not on every report: a report then
pays nothing for them, and a scrape sees the figures of that instant.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbank.ledger import Ledger

# Admission waits run from milliseconds (a free pool) to minutes (a long queue behind a big head).
WAIT_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A report is handled in tens of microseconds; the tail is what matters.
LATENCY_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1)


class SidecarMetrics:
    def __init__(self, ledger: Callable[[], Ledger | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def pool(figure: Callable[[Ledger], int]) -> Callable[[], float]:
            def read() -> float:
                current = ledger()
                return float(figure(current)) if current is not None else 0.0

            return read

        figures: dict[str, tuple[str, Callable[[Ledger], int]]] = {
            "total": ("pages in the pool, the sink page included", lambda lg: lg.total_pages),
            "free": ("free pages the engine last reported", lambda lg: lg.free),
            "evictable": ("cached pages eviction can reach", lambda lg: lg.evictable),
            "reserved": (
                "worst-case pages promised to running requests",
                lambda lg: sum(res.reserved for res in lg.running()),
            ),
            "outstanding": (
                "pages running requests may still take",
                lambda lg: lg.outstanding,
            ),
        }
        for name, (doc, figure) in figures.items():
            gauge = Gauge(f"kvbank_pages_{name}", doc, registry=r)
            gauge.set_function(pool(figure))
        Gauge("kvbank_queue_depth", "requests waiting for admission", registry=r).set_function(
            pool(lambda lg: lg.waiting_count())
        )
        self.admissions = Counter("kvbank_admissions", "requests admitted", registry=r)
        self.rejections = Counter(
            "kvbank_rejections", "requests refused: the pool can never hold them", registry=r
        )
        self.waits = Counter(
            "kvbank_waits", "admission passes that left a head waiting for room", registry=r
        )
        self.breaches = Counter(
            "kvbank_invariant_breaches", "reports that broke the safe-state invariant", registry=r
        )
        self.stalled_steps = Counter(
            "kvbank_peak_stalled_steps",
            "engine steps in which a running request could not advance, so the peak-fit ledger "
            "admitted conservatively until all advanced again",
            registry=r,
        )
        self.sessions_dropped = Counter(
            "kvbank_sessions_dropped",
            "engine sessions dropped (lease expired or replaced), with their reservations",
            registry=r,
        )
        self.admission_wait = Histogram(
            "kvbank_admission_wait_seconds",
            "time from a request's arrival at the sidecar to its admission",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.decision_latency = Histogram(
            "kvbank_decision_latency_seconds",
            "time the sidecar spends handling one engine report",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
