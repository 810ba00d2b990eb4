"""What a closed loop leaves to admission when one class runs one at a time: the scenario's own
requests and clients, with no pool at all. Requests of the `--serial` class run alone, one after
another, each for its output tokens at `--step-ms` a token; every other request runs as soon as
admission lets it, for its own output tokens.

- `fifo`: nothing passes a waiting request (the banker and peak-fit: a short request waits
  behind every long one ahead of it).
- `pass`: short requests start `--delay` seconds after they are sent, whatever waits ahead of
  them (backfill with the delay 0).

The long class is the throughput's bottleneck under both, so requests/s is the same, and by
Little's law (clients = requests/s x mean time in the system) what the short requests save the
long ones wait. Sweeping `--delay` shows how long the short requests must wait for the long
ones to wait less.

    .venv/bin/python benchmarks/closed_loop_bound.py [--scenario FILE] [--serial image]
        [--step-ms 8.356] [--delay 0,10,20,30]
"""

from __future__ import annotations

import argparse
import heapq
import math
from pathlib import Path

from kvbank.engine.bench.scenario import Scenario, load_scenario
from kvbank.engine.bench.workload import RequestSpec, generate

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) / 2) - 1)]


def run(
    scenario: Scenario, serial: str, step_s: float, passing: bool, delay: float
) -> dict[str, float]:
    clients = scenario.workload.concurrency
    if clients is None:
        raise SystemExit(f"{scenario.name} is open loop; this bound is for a closed loop")
    specs = generate(scenario.workload)
    clock, in_flight, done = 0.0, 0, 0
    queue: list[tuple[float, RequestSpec]] = []  # (sent, spec), in arrival order
    finishes: list[float] = []  # heap of finish times of running requests
    serial_free = 0.0  # when the running serial request ends
    ttft: dict[str, list[float]] = {}
    while True:
        while in_flight < clients and (spec := next(specs, None)) is not None:
            queue.append((clock, spec))
            in_flight += 1
        waiting: list[tuple[float, RequestSpec]] = []
        for sent, spec in queue:
            name = spec.cls.name
            blocked = bool(waiting) and not passing
            if name == serial:
                ready = serial_free <= clock and not any(s.cls.name == serial for _, s in waiting)
            else:
                ready = clock >= sent + (delay if passing else 0.0)
            if ready and not blocked:
                ttft.setdefault(name, []).append(clock - sent)
                end = clock + spec.output_tokens * step_s
                heapq.heappush(finishes, end)
                if name == serial:
                    serial_free = end
            else:
                waiting.append((sent, spec))
        queue = waiting
        events = list(finishes[:1]) + [s + delay for s, _ in queue if passing and s + delay > clock]
        if not events:
            break
        clock = min(events)
        while finishes and finishes[0] <= clock:
            heapq.heappop(finishes)
            in_flight -= 1
            done += 1
    return {
        "requests_per_s": round(done / clock, 4),
        **{f"ttft_p50_{name}_s": round(p50(v), 2) for name, v in sorted(ttft.items())},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(SCENARIOS / "image-chat-stress.yaml"))
    parser.add_argument("--serial", default="image", help="the class that runs one at a time")
    parser.add_argument("--step-ms", type=float, default=8.356, help="ms per decode step")
    parser.add_argument("--delay", default="0,10,20,30", help="short requests' waits to try (s)")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    step_s = args.step_ms / 1000
    print("fifo", run(scenario, args.serial, step_s, passing=False, delay=0.0))
    for delay in (float(d) for d in args.delay.split(",")):
        print(f"pass, delay {delay:g} s", run(scenario, args.serial, step_s, True, delay))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
