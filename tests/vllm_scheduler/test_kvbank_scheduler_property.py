"""Random workloads through vLLM's real scheduler under kvbank's admission, strict and
best-effort requests mixed: a request kvbank admitted (strict, or promoted) is never
preempted, a best-effort one at most `max_preemptions` times, the ledger stays safe and agrees
with vLLM's free blocks after every step, nothing hangs, and every request finishes (run to its
end, refused as never holdable, or aborted by its client). Embedded ledger, and a real `kvbank
sidecar` process, waited on and not; vLLM stepped synchronously and as its async scheduling
steps it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from vllm_builders import MODES, PAGE, bench, drive, pressure

from kvbank.engine.bench.vllm_engine import FinishReason
from kvbank.vllm.scheduler import make_backend
from kvbank.vllm.settings import Settings

pytestmark = pytest.mark.timeout(900)
PREFIXES = {"a": [11] * 200, "b": [12] * 120}  # shared system prompts, 12 and 7 pages

request = st.tuples(
    st.sampled_from([None, "a", "b"]),  # shared prefix
    st.integers(1, 160),  # own prompt tokens after it
    st.one_of(st.none(), st.integers(1, 160)),  # max_tokens (None: the server's default)
    st.integers(1, 200),  # where the model would stop
    st.integers(0, 40),  # arrival step
    st.one_of(st.none(), st.integers(0, 80)),  # abort step, if its client goes away
    st.sampled_from([None, None, "flex", "priority"]),  # service_tier (flex: best-effort)
)
workload = st.lists(request, min_size=1, max_size=24)


def _run(pages: int, policy: str, requests: list, mode: str, backend=None, pause_s=0.0,  # type: ignore[no-untyped-def]
         scheduling: str = "fcfs", order: tuple[str, int] = ("fifo", 0)) -> None:  # fmt: skip
    settings_ = Settings(policy, order=order[0], max_defer_steps=order[1])
    run = bench(pages, policy, backend=backend, async_scheduling=MODES[mode], scheduling=scheduling,
                settings=settings_)  # fmt: skip
    assert run.async_scheduling == MODES[mode]  # vLLM's engine core steps it so
    arrivals: dict[int, list] = {}
    aborts: dict[int, list[str]] = {}
    best_effort = set()
    for i, (prefix, own, max_tokens, output, at, abort, tier) in enumerate(requests):
        rid = f"r{i}"
        prompt = PREFIXES.get(prefix or "", []) + [100 + i] * own
        arrivals.setdefault(at, []).append((rid, prompt, max_tokens, output, tier))
        if tier == "flex":
            best_effort.add(rid)
        if abort is not None:
            aborts.setdefault(at + abort, []).append(rid)
    # A sidecar never waited on answers in wall time: steps that pause as a model's would.
    max_steps = 20000 if not pause_s else 60000
    seen = drive(run, arrivals, aborts, max_steps=max_steps, pause_s=pause_s)
    event(f"best-effort requests preempted: {bool(seen.preempted)}")
    event(f"promoted: {bool(run.sched.kvbank.classes.promoted)}")
    assert set(seen.preempted) <= best_effort  # strict requests never
    max_preemptions = run.sched.kvbank.classes.max_preemptions
    assert all(n <= max_preemptions for n in seen.preempted.values())  # then promoted: strict
    assert run.sched.kvbank.preemptions == 0
    assert set(seen.finished) == {f"r{i}" for i in range(len(requests))}
    never_holdable = {rid for rid, reason in seen.finished.items() if reason == FinishReason.ERROR}
    for rid in never_holdable:
        assert seen.tokens.get(rid, 0) == 0  # refused before it ran, not failed mid-way
    assert not run.sched.requests
    assert run.sched.kv_cache_manager.block_pool.get_num_free_blocks() == pages - 1
    assert run.sched.kvbank.backend.outstanding() == 0


# Found by this property: a strict request (r4) scheduled after a best-effort one (r3) with the
# same system prompt, in the same step, shares the blocks r3 has just taken. They come back when
# r4 ends (as reclaimable: only r3 holds them then), yet its exclusive pages counted r3 as a
# sharer, so the ledger heard 1 page of 8 would return and the peak-fit promise broke: "the
# running requests may need 15 more pages at step 93 from now but supply is 11".
SHARED_WITH_BEST_EFFORT = [
    (None, 1, None, 50, 16, None, None),
    (None, 18, None, 130, 0, None, None),
    ("a", 58, None, 97, 33, None, None),
    ("b", 1, None, 2, 33, None, "flex"),
    ("b", 1, 2, 2, 33, None, None),
]


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pages=st.integers(16, 96),
    policy=st.sampled_from(["banker", "peak+backfill", "peak", "banker+backfill"]),
    requests=workload,
    scheduling=st.sampled_from(["fcfs", "priority"]),  # vllm serve --scheduling-policy
    # KVBANK_ORDER and KVBANK_MAX_DEFER_STEPS (kvbank.vllm.order)
    order=st.sampled_from([("fifo", 0), ("prefix", 0), ("prefix", 4), ("prefix", 2048)]),
)
@example(pages=43, policy="peak+backfill", requests=SHARED_WITH_BEST_EFFORT, scheduling="fcfs",
         order=("fifo", 0))  # fmt: skip
def test_random_workloads_never_preempt_what_kvbank_admitted(
    mode: str, pages: int, policy: str, requests: list, scheduling: str, order: tuple[str, int]
) -> None:
    _run(pages, policy, requests, mode, scheduling=scheduling, order=order)


SIDECAR_PAGES = 48
_sessions = iter(range(1 << 30))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocking", [True, False], ids=["waits", "never-waits"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workload, order=st.sampled_from([("fifo", 0), ("prefix", 4), ("prefix", 2048)]))
def test_random_workloads_over_a_real_sidecar(
    sidecar: str, blocking: bool, mode: str, requests: list, order: tuple[str, int]
) -> None:
    """Waiting for each answer (a bench's run), and as a served vLLM runs: no schedule waits,
    decisions are applied a schedule or more later, the head's cached blocks pinned until then
    (and unpinned when the prefix order moves the head back)."""
    settings_ = Settings("peak+backfill", sidecar, token="vllm-property", blocking=blocking)
    backend = make_backend(
        settings_, SIDECAR_PAGES, PAGE, 0, engine_id=f"vllm-property-{next(_sessions)}"
    )
    pause_s = 0 if blocking else 0.001
    _run(SIDECAR_PAGES, "peak+backfill", requests, mode, backend, pause_s, order=order)
    # No session was lost and re-opened (none opens when every request left before a step).
    assert backend.sessions_opened <= 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocking", [True, False], ids=["waits", "never-waits"])
def test_best_effort_requests_under_pressure_over_a_real_sidecar(
    sidecar: str, blocking: bool, mode: str
) -> None:
    """vllm_builders.pressure, the ledger in the sidecar: only best-effort requests are
    preempted, some are promoted, every request finishes."""
    settings_ = Settings("peak+backfill", sidecar, token="vllm-property", blocking=blocking)
    backend = make_backend(settings_, 48, PAGE, 0, engine_id=f"vllm-property-{next(_sessions)}")
    run = bench(48, "peak+backfill", backend=backend, async_scheduling=MODES[mode])
    seen = drive(run, pressure("fcfs"), max_steps=60000, pause_s=0 if blocking else 0.001)
    assert seen.preempted and all(rid.startswith("be") for rid in seen.preempted)
    assert run.sched.kvbank.classes.promoted > 0
    assert run.sched.kvbank.preemptions == 0
    assert len(seen.finished) == 9 and not run.sched.requests
    assert backend.outstanding() == 0
    assert backend.sessions_opened == 1
