"""The banker's ledger with exact numbers: admission, leases, growth, release, refusals."""

import pytest
from ledger_pass import admit_all

from kvbank.capacity import CapacityModel, RequestShape, count_pages
from kvbank.ledger import (
    NO_HIT,
    Admitted,
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    Ledger,
    Refused,
    UnknownRequest,
)
from kvbank.modelpool import KvSlot


def make_ledger(pages: int = 96, **kw) -> Ledger:
    return Ledger(pages, debug=True, **kw)


class TestSeedRepro:
    """32 requests share a 59-page prompt in a 96-page pool (the seed's deadlock repro)."""

    model = CapacityModel({"main": KvSlot(1, 1)}, 16, 4096, 2048, 1)
    worst = count_pages(model, RequestShape(944, 160)).total  # 70 pages

    def test_without_the_hit_one_request_runs_at_a_time(self) -> None:
        ledger = make_ledger()
        for i in range(32):
            assert ledger.submit(f"r{i}", self.worst) is None
        assert [a.rid for a in admit_all(ledger)] == ["r0"]

    def test_with_the_hit_leased_three_run_at_once(self) -> None:
        ledger = make_ledger()
        for i in range(32):
            ledger.submit(f"r{i}", self.worst)
        # The prompt is cached and idle: 59 evictable pages, 36 free.
        ledger.set_supply(free=36, evictable=59)
        holders = 0

        def peek(rid: str) -> Hit:
            return Hit(59, 0 if holders else 59)

        admitted = []
        while (
            decision := ledger.try_admit(ledger.head or "", peek(ledger.head or ""))
        ) is not None:
            admitted.append(decision)
            holders += 1
        # r0 leases the 59 idle pages (supply 95 - 59 = 36) and still needs 11; each later
        # request shares the leased prefix and needs 11 more: 3 x 11 = 33 <= 36 < 44.
        assert [a.rid for a in admitted] == ["r0", "r1", "r2"]
        assert ledger.outstanding == 33
        assert (ledger.free, ledger.evictable) == (36, 0)
        assert all(a.reserved == 70 and a.hit.pages == 59 for a in admitted)

    def test_everything_finishes_in_fifo_order(self) -> None:
        ledger = make_ledger()
        for i in range(32):
            ledger.submit(f"r{i}", self.worst)
        order = []
        while ledger.waiting_count():
            for decision in admit_all(ledger):
                order.append(decision.rid)
                ledger.take(decision.rid, self.worst)  # grows to its full reservation
            for res in ledger.running():
                ledger.release(res.rid)
                ledger.set_supply(ledger.free + res.held, ledger.evictable)
        assert order == [f"r{i}" for i in range(32)]


class TestAdmission:
    def test_head_only_fifo_a_small_request_waits_behind_a_big_one(self) -> None:
        ledger = make_ledger(101)  # 100 usable
        ledger.submit("big-running", 60)
        admit_all(ledger)
        ledger.submit("big", 60)
        ledger.submit("small", 5)
        assert admit_all(ledger) == []
        assert ledger.head == "big"

    def test_admission_is_outstanding_plus_need_against_supply_minus_idle_hit(self) -> None:
        ledger = make_ledger(101, free=50, evictable=50)
        ledger.submit("x", 15)
        admit_all(ledger)
        ledger.submit("a", 90)
        # An idle hit saves nothing: its pages leave the supply as they are leased.
        # 15 + (90 - 40) = 65 > 100 - 40
        assert ledger.try_admit("a", Hit(40, 40)) is None
        # A hit a running request already holds is shared: 65 <= 100
        admitted = ledger.try_admit("a", Hit(40, 0))
        assert admitted == Admitted("a", 1, 90, Hit(40, 0))
        assert (ledger.outstanding, ledger.free, ledger.evictable) == (65, 50, 50)

    def test_leasing_an_idle_hit_takes_it_off_the_evictable_supply(self) -> None:
        ledger = make_ledger(101, free=50, evictable=50)
        ledger.submit("a", 90)
        assert ledger.try_admit("a", Hit(40, 40)) is not None
        assert (ledger.outstanding, ledger.free, ledger.evictable) == (50, 50, 10)

    def test_a_request_the_pool_can_never_hold_is_refused_at_once(self) -> None:
        ledger = make_ledger(96)
        decision = ledger.submit("huge", 96)
        assert isinstance(decision, Refused)
        assert "needs 96 KV pages" in decision.message and "at least 97" in decision.message
        assert ledger.waiting_count() == 0
        assert decision.seq == 0 and ledger.next_seq == 1

    def test_the_callers_refusal_message_is_kept(self) -> None:
        decision = make_ledger(10).submit("x", 10, refusal="lower max_tokens to at most 3")
        assert isinstance(decision, Refused)
        assert decision.message == "lower max_tokens to at most 3"

    def test_a_full_pool_request_fits_exactly(self) -> None:
        ledger = make_ledger(96)
        assert ledger.submit("exact", 95) is None
        assert [a.rid for a in admit_all(ledger)] == ["exact"]

    def test_decisions_carry_increasing_sequence_numbers(self) -> None:
        ledger = make_ledger(100)
        for rid in "abc":
            ledger.submit(rid, 10)
        assert [a.seq for a in admit_all(ledger)] == [0, 1, 2]

    def test_a_head_that_does_not_fit_is_answered_none_and_nothing_changes(self) -> None:
        ledger = make_ledger(20)
        ledger.submit("a", 15)
        admit_all(ledger)
        ledger.submit("b", 15)
        before = ledger.snapshot()
        assert ledger.try_admit("b", NO_HIT) is None
        assert ledger.snapshot() == before

    def test_a_try_for_a_request_that_is_not_waiting_raises(self) -> None:
        ledger = make_ledger(20)
        ledger.submit("a", 5)
        with pytest.raises(UnknownRequest):
            ledger.try_admit("zz", NO_HIT)

    def test_a_request_behind_the_head_is_not_admitted_without_a_promise(self) -> None:
        ledger = make_ledger(20)
        ledger.submit("a", 15)
        ledger.submit("b", 2)
        # Behind the head, before the head was asked (no promise): not now, even though it fits.
        assert ledger.try_admit("b", NO_HIT) is None
        assert ledger.try_admit("a", NO_HIT) is not None


class TestRunning:
    def test_take_and_release(self) -> None:
        ledger = make_ledger(101)
        ledger.submit("a", 30)
        admit_all(ledger)
        ledger.take("a", 10)
        assert (ledger.outstanding, ledger.supply) == (20, 90)
        res = ledger.release("a")
        assert (res.reserved, res.held) == (30, 10)
        assert ledger.outstanding == 0
        ledger.set_supply(100, 0)
        assert ledger.supply == 100

    def test_take_evicts_after_free_runs_out(self) -> None:
        ledger = make_ledger(101, free=5, evictable=95)
        ledger.submit("a", 30)
        admit_all(ledger)
        ledger.take("a", 8)
        assert (ledger.free, ledger.evictable) == (0, 92)

    def test_taking_more_than_reserved_is_refused_and_changes_nothing(self) -> None:
        ledger = make_ledger(101)
        ledger.submit("a", 30)
        admit_all(ledger)
        ledger.take("a", 25)
        before = ledger.snapshot()
        with pytest.raises(InvalidPages, match="may take at most 5 more"):
            ledger.take("a", 6)
        assert ledger.snapshot() == before

    def test_restore_re_registers_a_running_request(self) -> None:
        ledger = make_ledger(101, free=80, evictable=0)
        res = ledger.restore("a", reserved=40, held=20)
        assert (res.reserved, res.held, ledger.outstanding) == (40, 20, 20)

    def test_cancel_a_waiting_request(self) -> None:
        ledger = make_ledger()
        ledger.submit("a", 10)
        ledger.cancel("a")
        assert ledger.head is None


class TestBadInput:
    @pytest.mark.parametrize("pages", [-1, 1.5, True, "3"])
    def test_bad_page_counts(self, pages) -> None:
        ledger = make_ledger()
        before = ledger.snapshot()
        with pytest.raises(InvalidPages):
            ledger.submit("a", pages)
        assert ledger.snapshot() == before

    def test_absurd_growth_is_refused(self) -> None:
        ledger = make_ledger()
        ledger.submit("a", 10)
        admit_all(ledger)
        with pytest.raises(InvalidPages, match="exceeds the pool's 96 pages"):
            ledger.take("a", 10**9)

    def test_duplicate_and_unknown_ids(self) -> None:
        ledger = make_ledger()
        ledger.submit("a", 10)
        with pytest.raises(DuplicateRequest):
            ledger.submit("a", 10)
        with pytest.raises(UnknownRequest, match="'zz' is not running"):
            ledger.take("zz", 1)
        with pytest.raises(UnknownRequest):
            ledger.release("zz")
        with pytest.raises(UnknownRequest):
            ledger.cancel("zz")
        with pytest.raises(InvalidPages):
            ledger.submit("", 1)

    def test_a_hit_larger_than_the_request_or_the_idle_supply(self) -> None:
        ledger = make_ledger(101, free=90, evictable=10)
        ledger.submit("a", 20)
        with pytest.raises(InvalidPages):
            ledger.try_admit("a", Hit(30, 0))
        with pytest.raises(InvalidPages):
            ledger.try_admit("a", Hit(15, 12))

    def test_supply_beyond_the_pool(self) -> None:
        with pytest.raises(InvalidPages, match="exceeds"):
            make_ledger(10).set_supply(8, 5)

    def test_a_pool_without_room_for_the_sink_page(self) -> None:
        with pytest.raises(InvalidPages, match="at least 2 pages"):
            Ledger(1)


class TestIntegrity:
    def test_a_supply_report_below_outstanding_is_a_breach_with_numbers(self) -> None:
        ledger = make_ledger(101)
        ledger.submit("a", 60)
        admit_all(ledger)
        with pytest.raises(InvariantBreach, match=r"outstanding 60 pages exceed supply 50"):
            ledger.set_supply(50, 0)

    def test_without_debug_the_breach_is_found_by_check_integrity(self) -> None:
        ledger = Ledger(101)
        ledger.submit("a", 60)
        admit_all(ledger)
        ledger.set_supply(50, 0)
        with pytest.raises(InvariantBreach, match="'a' with 60 pages still to take"):
            ledger.check_integrity()

    def test_no_hit_is_the_default(self) -> None:
        assert Hit(0, 0) == NO_HIT
