"""The peak-fit ledger's breach on a mix of strict image requests and best-effort chat, and the
second safety check (engine/safety.py) that recomputes the promise from the pool's raw state.

The breach: a best-effort request leased a strict request's prompt pages, and the next exact
count of that strict request's exclusive pages (after any release) counted every holder, so
those pages stopped counting as returned when it finishes while the supply stayed the same
(they come back as pages only a best-effort request holds, which the supply counts). The
ledger's own invariant then broke and the run stopped. Exclusive pages are now counted by
strict holders (`CacheView.exclusive_pages`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from engine_builders import finish, tiny_model

from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.kv.view import CacheView
from kvbank.engine.request import Request, Status
from kvbank.ledger import InvariantBreach
from kvbank.mode import LEDGER_MODE_NAMES
from kvbank.service_class import ServiceClass

BE = ServiceClass.BEST_EFFORT
SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "image-chat-best-effort.yaml"
PREFIX = list(range(1, 17))  # four full pages at page size 4


def _every_holder(view: CacheView, req: Request) -> int:
    """The old count: pages no other request of any class holds."""
    refcount = view._refcount
    shared = sum(
        1 for table in req.pages.values() for page in table[: req.indexed] if refcount[page] > 1
    )
    return req.held - shared


def _strict_prefix_leased_by_best_effort(debug: bool) -> tuple[Engine, Request, Request]:
    """Page size 4, 13 pages (12 usable), peak-fit. s1 (17-token prompt, 16 tokens out) holds
    its prompt's four pages; s2 (40 tokens out) was admitted counting on s1's pages coming
    back (9 + 11 reserved > 12); best-effort b leases s1's four prompt pages and s3 finishes in
    the same step, so the next report counts exclusive pages afresh."""
    model = tiny_model(page_size=4, max_seq_len=128, max_tokens=64)
    engine = Engine(EngineConfig(model, 13, "peak", 64, debug=debug), VirtualRunner())
    s1 = engine.add_request("s1", [*PREFIX, 99], 16)
    engine.step()
    engine.step()
    s2 = engine.add_request("s2", [200, 201, 202], 40)
    for _ in range(3):
        engine.step()
    assert (s1.pages, s1.worst, s2.held, s2.worst, engine.kv.free) == (
        {"main": [1, 2, 3, 4, 5, 7]},
        9,
        2,
        11,
        4,
    )
    b = engine.add_request("b", [*PREFIX, 300], 3, service_class=BE)
    engine.add_request("s3", [400], 1)
    return engine, s1, b


def test_a_best_effort_lease_of_a_strict_prefix_keeps_those_pages_returning() -> None:
    engine, s1, b = _strict_prefix_leased_by_best_effort(debug=True)
    engine.step()  # debug: the ledger's invariant and the second check, deeply
    assert b.status is Status.RUNNING and b.pages == {"main": [1, 2, 3, 4, 10]}
    assert [engine.kv.pool.refcount[p] for p in s1.pages["main"]] == [2, 2, 2, 2, 1, 1]
    view = engine.sched.view.kv
    # All six return to the supply when s1 finishes: four as pages only b holds.
    assert (view.exclusive_pages(s1), _every_holder(view, s1)) == (6, 2)
    finish(engine)


def test_counted_by_every_holder_the_ledger_breaks_while_the_pool_was_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old count, kept as a test: the ledger's own invariant fails on the very state the
    second check finds safe, because the pages it stopped counting still return."""
    monkeypatch.setattr(CacheView, "exclusive_pages", _every_holder)
    engine, _, _ = _strict_prefix_leased_by_best_effort(debug=False)
    engine.step()
    with pytest.raises(InvariantBreach, match="may need 7 more pages at step 35"):
        engine.check_integrity()
    engine.check_safety()


@pytest.mark.parametrize("policy", LEDGER_MODE_NAMES)
def test_the_mixed_scenario_finishes_under_every_ledger_policy(policy: str) -> None:
    """400 requests: strict images with fixed tokens in three labels, best-effort chat sharing
    a 256-token system prompt, a host tier, an open loop; the second check after every step."""
    metrics = run_policy(load_scenario(SCENARIO), policy, check=True).metrics
    assert (metrics["completed"], metrics["hung"], metrics["invariant_breaches"]) == (400, 0, 0)
    assert metrics["stopped"] == "finished"


def test_the_mixed_scenario_broke_the_peak_ledger_with_the_old_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CacheView, "exclusive_pages", _every_holder)
    metrics = run_policy(load_scenario(SCENARIO), "peak", check=True).metrics
    assert metrics["invariant_breaches"] == 1
    assert metrics["stopped"].startswith("invariant breach: the running requests may need")


# ---- the second check catches what the ledger's own check cannot --------------------------------


def _two_strict_requests(policy: str, forge: bool) -> Engine:
    """Two strict requests of 8 worst-case pages on 12 usable: only one fits at once. With
    `forge`, the ledger is handed a shape for the second that never grows (the engine's
    count is honest): the ledger's books then agree with themselves, and it admits both."""
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=28)
    engine = Engine(EngineConfig(model, 13, policy, 64), VirtualRunner())
    engine.add_request("a", [1, 2, 3, 4], 28)
    b = engine.add_request("b", [5, 6, 7, 8], 28)
    if forge:
        b.peak_shape = replace(b.peak_shape, per_output=(0,))
        engine.policy.backend.ledger.books.waiting["b"].shape = b.peak_shape  # type: ignore[attr-defined]
    engine.step()
    return engine


@pytest.mark.parametrize("policy", ["peak", "peak+backfill"])
def test_a_forged_shape_admits_past_the_pool_and_only_the_second_check_sees_it(
    policy: str,
) -> None:
    engine = _two_strict_requests(policy, forge=False)
    assert engine.num_running == 1  # honest, the second waits
    engine.check_safety()
    engine = _two_strict_requests(policy, forge=True)
    assert engine.num_running == 2
    engine.check_integrity()  # the ledger agrees with what it was told
    with pytest.raises(InvariantBreach, match="second check: the running strict requests may"):
        engine.check_safety()


def test_the_conservative_reading_sees_a_supply_told_high(monkeypatch: pytest.MonkeyPatch) -> None:
    """The banker's second check sums what each running strict request may still take against
    the raw pool: a ledger told of 4 evictable pages the pool does not have admits the second
    request and agrees with itself."""
    real = CacheView.ledger_supply
    # 4 more evictable pages than there are, once `a` runs (within the 12 usable pages).
    monkeypatch.setattr(
        CacheView, "ledger_supply", lambda view: (real(view)[0], 4 if real(view)[0] <= 8 else 0)
    )
    model = tiny_model(page_size=4, max_seq_len=64, max_tokens=28)
    engine = Engine(EngineConfig(model, 13, "banker", 64), VirtualRunner())
    engine.add_request("a", list(range(1, 21)), 12)  # 8 pages, 5 held from its start
    engine.step()
    engine.add_request("b", [30, 31, 32, 33], 28)  # 8 pages: 3 + 8 > 7 free
    engine.step()
    assert engine.num_running == 2
    engine.check_integrity()
    with pytest.raises(InvariantBreach, match="may still take 9 pages but the pool can hand out 5"):
        engine.check_safety()


def test_a_page_held_outside_every_table_is_found() -> None:
    model = tiny_model(page_size=4)
    engine = Engine(EngineConfig(model, 13, "peak", 64), VirtualRunner())
    engine.add_request("a", [1, 2, 3, 4, 5], 4)
    engine.step()
    engine.kv.pool.allocate()  # a reference no request accounts for
    with pytest.raises(InvariantBreach, match="the pool counts 1 references"):
        engine.check_safety()


def test_the_baselines_promise_nothing_and_are_not_checked() -> None:
    model = tiny_model(page_size=4)
    engine = Engine(EngineConfig(model, 13, "optimistic", 64), VirtualRunner())
    assert engine.safety is None
    engine.check_safety()
