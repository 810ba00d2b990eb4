"""The requests a scenario sends: deterministic for its seed, generated lazily in arrival order."""

from __future__ import annotations

import random
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvbank.engine.bench.scenario import RequestClass, Workload
from kvbank.engine.bench.virtual import VOCAB


@dataclass(frozen=True)
class RequestSpec:
    rid: str
    cls: RequestClass
    prompt: list[int]
    output_tokens: int  # where the model would stop
    arrival_s: float | None  # open loop: when it arrives; closed loop: None (when a client frees)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [2 + rng.getrandbits(30) % (VOCAB - 2) for _ in range(count)]


def generate(workload: Workload) -> Iterator[RequestSpec]:
    rng = random.Random(workload.seed)
    prefixes: dict[str, list[int]] = {}
    classes = workload.classes
    weights = [c.weight for c in classes]
    clock = 0.0
    burst_left = 0  # requests still to come at `clock` in the current burst
    for index in range(workload.requests):
        cls = rng.choices(classes, weights)[0]
        prompt_len = cls.prompt_tokens.sample(rng)
        output = cls.output_tokens.sample(rng)
        prompt: list[int] = []
        if cls.shared_prefix is not None:
            group = cls.shared_prefix
            if group not in prefixes:
                group_rng = random.Random(zlib.crc32(f"{workload.seed}:{group}".encode()))
                prefixes[group] = _tokens(group_rng, cls.shared_prefix_tokens)
            prefix = prefixes[group]
            if len(prefix) < cls.shared_prefix_tokens:  # another class asks for a longer one
                prefix.extend(_tokens(rng, cls.shared_prefix_tokens - len(prefix)))
            prompt = prefix[: cls.shared_prefix_tokens]
        prompt = prompt + _tokens(rng, prompt_len - len(prompt))
        arrival = None
        if workload.rate_per_s is not None:
            if burst_left == 0:
                clock += rng.expovariate(workload.rate_per_s)
                burst_left = workload.burst.sample(rng) if workload.burst is not None else 1
            burst_left -= 1
            arrival = clock
        yield RequestSpec(f"{cls.name}-{index}", cls, prompt, output, arrival)


class Arrivals:
    """Feeds a run its requests as the scenario sends them: a closed loop keeps `concurrency`
    requests in flight, an open loop sends each once the clock reaches its arrival. Every
    engine the bench drives (its own, vLLM's) takes requests from one of these, so both see the
    same traffic at the same virtual times."""

    def __init__(self, workload: Workload) -> None:
        self._concurrency = workload.concurrency
        self._specs = generate(workload)
        self._upcoming: deque[RequestSpec] = deque()

    def refill(
        self, clock: float, in_flight: Callable[[], int], send: Callable[[RequestSpec], None]
    ) -> None:
        """Send what is due at `clock`; `in_flight` is asked again after each send (a refused
        request frees its client at once)."""
        if self._concurrency is not None:
            while in_flight() < self._concurrency:
                spec = next(self._specs, None)
                if spec is None:
                    return
                send(spec)
            return
        while True:
            if not self._upcoming:
                spec = next(self._specs, None)
                if spec is None:
                    return
                self._upcoming.append(spec)
            if (self._upcoming[0].arrival_s or 0.0) > clock:
                return
            send(self._upcoming.popleft())

    def idle_until(self, clock: float) -> float | None:
        """With nothing running: the clock at the next open-loop arrival, or None if none is
        coming."""
        if not self._upcoming:
            return None
        return max(clock, self._upcoming[0].arrival_s or clock)
