"""The picker's Prometheus metrics, on a registry of its own (tests run several pickers in
one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# A decision is a parse, a count and a hold round trip on the pod network: tens of
# microseconds to a few milliseconds.
DECISION_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.25)
# A held request waits for a pod to free room: a step to many seconds.
HELD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class PickerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.answers = Counter(
            "kvbank_picker_answers",
            "requests answered, by outcome: pick, wait (picked where it starts soonest), "
            "refused (400), shed (429), no_endpoint (503), bad_request (4xx)",
            ["outcome"],
            registry=r,
        )
        self.decision = Histogram(
            "kvbank_picker_decision_seconds",
            "from a request's last body chunk to the picker's answer, less the time it was held",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            "kvbank_picker_held_requests",
            "strict requests held now because no pod's ledger admits them yet",
            registry=r,
        )
        self.held_seconds = Histogram(
            "kvbank_picker_held_seconds",
            "how long a strict request was held until a pod admitted it (or --max-hold-s)",
            buckets=HELD_BUCKETS,
            registry=r,
        )
        self.hold_latency = Histogram(
            "kvbank_picker_hold_seconds",
            "one Hold call to a pod's sidecar",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.hold_refusals = Counter(
            "kvbank_picker_hold_refusals",
            "holds a sidecar refused because another pick took the room first",
            registry=r,
        )
        self.hold_failures = Counter(
            "kvbank_picker_hold_failures",
            "Hold calls that failed (by gRPC code): the request was routed elsewhere",
            ["code"],
            registry=r,
        )
        self.pod_losses = Counter(
            "kvbank_picker_pod_losses",
            "times a pod's sidecar stream broke or went silent, taking it out of the candidates",
            ["pod"],
            registry=r,
        )
        self.pods_live = Gauge(
            "kvbank_picker_pod_live",
            "1 while the pod's sidecar stream is live (the pod is a candidate), else 0",
            ["pod"],
            registry=r,
        )

    def pod_lost(self, pod: str) -> None:
        self.pod_losses.labels(pod).inc()
        self.pods_live.labels(pod).set(0)

    def pod_live(self, pod: str, live: bool) -> None:
        self.pods_live.labels(pod).set(1 if live else 0)
