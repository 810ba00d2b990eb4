"""Cost of the peak-fit admission check at 256 running requests.

Builds a ledger with 256 running chat requests at random progress (prompt 100-2000 tokens,
max_tokens 1024, pageSize 16, one speculative token, one token written per step as the engine
configures it) and a pool sized so that the conservative test refuses the head, then times
(1) the check with the profile already built (what every further check in a step costs),
(2) bringing the profile up to date after a typical step's progress reports (every request one
token further, a page taken at each page boundary, finished requests released), (3) the same
after a step in which every request deviated from its bound (two tokens: a rebuild), (4) the
step's progress reports themselves (ledger bookkeeping, paid with or without a waiting head),
and (5) the backfill promise for the blocked head. Prints medians in microseconds.

    .venv/bin/python benchmarks/admission_check.py [--running 256] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from kvbank.capacity import CapacityModel, RequestShape
from kvbank.ledger import Hit, Ledger, PeakPolicy, PeakShape, peak_shape
from kvbank.modelpool import KvSlot

PAGE = 16


def build(running: int, seed: int) -> tuple[Ledger, PeakShape]:
    """A ledger with `running` requests at random progress. They are admitted into a pool large
    enough for all their worst cases, then the pool reports the supply a peak-admitted pool
    would have: what they hold leaves a quarter of what they may still take."""
    rng = random.Random(seed)
    model = CapacityModel({"main": KvSlot(1, 1, 0)}, PAGE, 8192, 1024, 1)
    shapes = [peak_shape(model, RequestShape(rng.randint(100, 2000), 1024)) for _ in range(running)]
    worst = sum(s.pages for s in shapes)
    policy = PeakPolicy(PAGE, 1, peak=True, backfill=True, max_advance=1)
    ledger = Ledger(worst + 1, policy=policy)
    held = 0
    for i, shape in enumerate(shapes):
        rid = f"r{i}"
        ledger.submit(rid, shape.pages, shape=shape)
        assert ledger.try_admit(rid) is not None
        produced = rng.randint(0, shape.output_budget - 1)
        pages = -(-(shape.base[0] + produced) // PAGE)
        ledger.take(rid, pages)
        ledger.advance(rid, produced)
        held += pages
    ledger.set_supply((worst - held) // 4, 0)
    return ledger, peak_shape(model, RequestShape(1500, 1024))


def median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def step(ledger: Ledger, tokens: int) -> None:
    """One engine step's reports: each running request `tokens` further (its budget allowing),
    the pages its written tokens need taken, a request at its budget released."""
    timeline = ledger.timeline
    assert timeline is not None
    for rid, track in list(timeline.tracks.items()):
        if track.produced >= track.budget:
            ledger.release(rid)
            continue
        produced = min(track.budget, track.produced + tokens)
        pages = -(-(track.base[0] + produced) // PAGE) - track.held
        if pages:
            ledger.take(rid, pages)
        ledger.advance(rid, produced)
    ledger.end_step()


def profile_after_steps(ledger: Ledger, tokens: int, steps: int) -> tuple[float, float]:
    """Medians over `steps` steps of (the step's reports, the profile brought up to date)."""
    timeline = ledger.timeline
    assert timeline is not None
    reports, profiles = [], []
    for _ in range(steps):
        timeline.profile()
        start = time.perf_counter_ns()
        step(ledger, tokens)
        middle = time.perf_counter_ns()
        timeline.profile()
        reports.append(middle - start)
        profiles.append(time.perf_counter_ns() - middle)
    return statistics.median(reports) / 1000, statistics.median(profiles) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    ledger, head = build(args.running, args.seed)
    timeline = ledger.timeline
    assert timeline is not None
    supply = ledger.supply
    hold = Hit(0, 0, 0)
    timeline.profile()
    check = median_us(lambda: timeline.fits(head, hold, supply), args.repeats)
    promise = median_us(lambda: timeline.promise("head", head, supply), max(50, args.repeats // 20))
    verdict = timeline.fits(head, hold, supply)
    steps = max(50, args.repeats // 20)
    reports_us, typical_us = profile_after_steps(ledger, 1, steps)
    _, deviated_us = profile_after_steps(ledger, 2, max(10, steps // 5))
    print(f"running requests: {args.running}, supply {supply} pages, head fits: {verdict}")
    print(f"admission check (profile built): median {check:.1f} us")
    print(f"profile after a typical step (one token each): median {typical_us:.1f} us")
    print(f"profile after a step in which every curve changed: median {deviated_us:.1f} us")
    print(f"the step's progress reports (ledger bookkeeping): median {reports_us:.1f} us")
    print(f"backfill promise for the blocked head: median {promise:.1f} us")
    print(f"running at the end: {len(timeline.tracks)} ({steps} typical steps run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
