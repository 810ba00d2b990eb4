"""Prometheus figures of one engine: requests by outcome, tokens, latency, the pool and the queue.

Each server has its own registry (two servers in one test process do not collide). Pool gauges
are set by the engine thread after each step, so a scrape never touches the engine.

Three gauges carry the names the Gateway API Inference Extension's model-server protocol gives
for vLLM-compatible servers, so its endpoint picker routes to kvbank unchanged:
`vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`, with
`vllm:cache_config_info` for the pool's page size and page count. kvbank's
usage is the *promised* fraction of the pool (pages reserved for admitted requests, held or not
yet taken, over usable pages), not the held one: a replica whose pages are all spoken for reads
full before its requests have grown into them, so a gateway routes new work elsewhere.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbank.capacity import worst_case
from kvbank.engine.engine import Engine, RequestOutput
from kvbank.engine.serve.http.class_metrics import PreemptionCounter, RecomputeMeter
from kvbank.service_class import ServiceClass


class ServeMetrics:
    def __init__(self, total_pages: int, page_size: int | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        if page_size is not None:
            # vLLM's static cache figures, which GAIE's and llm-d's metric readers take the
            # pool's block size and block count from (docs/routing.md).
            Gauge(
                "vllm:cache_config_info",
                "the KV cache's configuration, in its labels (value 1): tokens per page "
                "(block_size) and pages in the pool (num_gpu_blocks)",
                ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
                registry=registry,
            ).labels(str(page_size), str(total_pages), "True").set(1)
        self.requests = Counter(
            "kvbank_requests", "HTTP generation requests by outcome", ["outcome"], registry=registry
        )
        self.prompt_tokens = Counter(
            "kvbank_prompt_tokens", "prompt tokens of accepted requests", registry=registry
        )
        self.generated_tokens = Counter(
            "kvbank_generated_tokens", "tokens sampled by the engine", registry=registry
        )
        self.steps = Counter("kvbank_engine_steps", "engine steps that ran rows", registry=registry)
        self.ttft = Histogram(
            "kvbank_time_to_first_token_seconds",
            "from submission to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.tpot = Histogram(
            "kvbank_time_per_output_token_seconds",
            "per request, from its first token to its last, over the tokens after the first",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.gateway_waiting = Gauge(
            "vllm:num_requests_waiting",
            "requests awaiting admission (Gateway API Inference Extension: TotalQueuedRequests)",
            registry=registry,
        )
        self.gateway_running = Gauge(
            "vllm:num_requests_running",
            "admitted requests (Gateway API Inference Extension: TotalRunningRequests)",
            registry=registry,
        )
        self.gateway_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "promised fraction of the KV pool, 0..1: pages admitted requests hold or may still "
            "take, over usable pages (Gateway API Inference Extension: KVCacheUtilization)",
            registry=registry,
        )
        self.preemptions = Counter(
            "kvbank_preemptions",
            "running requests preempted (by recompute or retraction) to free pages, by service "
            "class; kvbank's own policies never preempt a strict request (the preempt and ratio "
            "baselines ignore classes and do)",
            ["service_class"],
            registry=registry,
        )
        self.recomputed_tokens = Counter(
            "kvbank_recomputed_tokens",
            "positions whose KV was computed again after a preemption (what the prefix cache "
            "and the host tier could not give back), by service class",
            ["service_class"],
            registry=registry,
        )
        self.class_requests = Counter(
            "kvbank_class_requests",
            "requests the engine queued, by the service class it granted (strict, whatever its "
            "service_tier, when its KV cannot be rebuilt, it is a group of n > 1 sequences, or "
            "the policy honours no class)",
            ["service_class"],
            registry=registry,
        )
        for cls in ServiceClass:  # every series exists from the start, at 0
            self.preemptions.labels(cls.value)
            self.recomputed_tokens.labels(cls.value)
            self.class_requests.labels(cls.value)
        self._preempted = PreemptionCounter(
            lambda cls, n: self.preemptions.labels(cls.value).inc(n)
        )
        self.running = Gauge("kvbank_running_requests", "admitted requests", registry=registry)
        self.waiting = Gauge(
            "kvbank_waiting_requests", "requests awaiting admission", registry=registry
        )
        self.total_pages = Gauge(
            "kvbank_pool_pages", "KV pages per rank, the sink page included", registry=registry
        )
        self.free_pages = Gauge("kvbank_pool_free_pages", "pages nobody holds", registry=registry)
        self.evictable_pages = Gauge(
            "kvbank_pool_evictable_pages", "cached pages eviction can take", registry=registry
        )
        self.held_pages = Gauge(
            "kvbank_pool_held_pages", "pages held by running requests", registry=registry
        )
        self.outstanding_pages = Gauge(
            "kvbank_outstanding_pages",
            "pages admitted requests may still take: the ledger's outstanding under every "
            "ledger policy, embedded or in the sidecar; under a baseline, what its running "
            "requests may still take unpromised",
            registry=registry,
        )
        self.prefix_hit_tokens = Counter(
            "kvbank_prefix_hit_tokens",
            "prompt positions admissions took from the prefix cache instead of computing",
            registry=registry,
        )
        self.host_pages = Gauge(
            "kvbank_host_pages",
            "evicted prefix pages kept on the host tier for reload",
            registry=registry,
        )
        self.host_moves = Counter(
            "kvbank_host_pages_moved",
            "pages copied between the device pool and the host tier",
            ["direction"],
            registry=registry,
        )
        self._host_seen = {"to-host": 0, "to-device": 0}
        for direction in self._host_seen:
            self.host_moves.labels(direction)
        self.stalled_steps = Counter(
            "kvbank_peak_stalled_steps",
            "steps in which a running request could not advance, so peak-fit admission fell "
            "back to the conservative reading until all advanced again",
            registry=registry,
        )
        self.usable_pages = max(1, total_pages - 1)  # the sink page holds nothing
        # For pickers configured by metrics alone (llm-d's metrics extractor, docs/routing.md):
        # what the ledger would admit now, in pages and in the pool's worst-case requests.
        self.headroom = Gauge(
            "kvbank_headroom_pages",
            "pages a request admitted now may take with every promise kept (the ledger's)",
            registry=registry,
        )
        self.admissible_worst_case = Gauge(
            "kvbank_admissible_worst_case_requests",
            "worst-case requests of this pool the ledger would admit now, one after another",
            registry=registry,
        )
        self._worst_pages: int | None = None
        self._hit_tokens_seen = 0
        self._stalled_seen = 0
        self.total_pages.set(total_pages)

    def observe_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after every step (and when idle)."""
        if outputs:
            self.steps.inc()
            self.generated_tokens.inc(sum(len(o.new_token_ids) for o in outputs))
        hit_tokens = engine.sched.stats.hit_tokens
        if hit_tokens > self._hit_tokens_seen:
            self.prefix_hit_tokens.inc(hit_tokens - self._hit_tokens_seen)
            self._hit_tokens_seen = hit_tokens
        kv = engine.kv
        if kv.host is not None:
            self.host_pages.set(len(kv.host))
            for direction, total in (("to-host", kv.host.saved), ("to-device", kv.host.loaded)):
                if total > self._host_seen[direction]:
                    self.host_moves.labels(direction).inc(total - self._host_seen[direction])
                    self._host_seen[direction] = total
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.free_pages.set(kv.free)
        self.evictable_pages.set(kv.evictable)
        self.held_pages.set(kv.pool.held)
        outstanding = outstanding_pages(engine)
        self.outstanding_pages.set(outstanding)
        self.gateway_waiting.set(engine.num_waiting)
        self.gateway_running.set(engine.num_running)
        promised = kv.pool.held + outstanding
        backend = engine.backend or getattr(engine.policy, "backend", None)
        if backend is not None:  # a baseline keeps no ledger, so it has no headroom to show
            if self._worst_pages is None:
                self._worst_pages = max(1, worst_case(engine.config.model)[1].total)
            # A figure read, not an answer: under tensor parallelism rank 0's recording wrapper
            # would hand it to the followers, which never ask it (`inner`: the ledger itself).
            headroom = max(0, int(getattr(backend, "inner", backend).headroom()))
            self.headroom.set(headroom)
            self.admissible_worst_case.set(headroom // self._worst_pages)
        self.gateway_usage.set(min(1.0, promised / self.usable_pages))
        self._preempted.observe(engine, [o.rid for o in outputs if o.finished])
        stalled = getattr(engine.policy, "stalled_steps", 0)  # only peak-fit ledgers count them
        if stalled > self._stalled_seen:
            self.stalled_steps.inc(stalled - self._stalled_seen)
            self._stalled_seen = stalled

    def meter_recompute(self, engine: Engine) -> None:
        """Count recomputed positions by class: the engine's runner is wrapped by a meter (after
        any tensor-parallel wrapper, so rank 0 counts what every rank computes once)."""
        engine.runner = RecomputeMeter(
            engine.runner, engine, lambda cls, n: self.recomputed_tokens.labels(cls.value).inc(n)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def outstanding_pages(engine: Engine) -> int:
    """Pages admitted requests may still take. A ledger policy's backend knows (the banker's is
    the engine's; a peak-fit policy keeps its own when the ledger is embedded); a baseline keeps
    no ledger, so it is what its running requests may still take, promised or not."""
    backend = engine.backend or getattr(engine.policy, "backend", None)
    if backend is not None:
        return int(backend.outstanding())
    return sum(max(0, r.worst - r.held) for r in engine.sched.running.values())
