"""The engine's step loop: admission, chunked prefill, multi-label pages, stops, bad requests."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace

import pytest
from engine_builders import drain, make_engine, tiny_model

from kvbank.capacity import RequestShape, count_pages, refusal
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.engine.kv.pages import SINK_PAGE
from kvbank.engine.request import FinishReason
from kvbank.engine.runner import RowFailure, StepBatch, StepResult
from kvbank.ledger import NO_HIT, Decision, Hit, InvalidPages
from kvbank.ledger.client import EmbeddedClient, embedded
from kvbank.modelpool import KvSlot


def test_a_request_runs_to_max_tokens_and_returns_every_page() -> None:
    engine, _ = make_engine(20)
    engine.add_request("a", list(range(10)), max_tokens=5)
    first = engine.step()
    assert [(o.rid, len(o.new_token_ids), o.finished) for o in first] == [("a", 1, False)]
    finished, _ = drain(engine)
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert engine.kv.pool.held == 0 and engine.kv.supply == 19


def test_the_runner_stop_token_ends_a_request_early() -> None:
    engine, runner = make_engine(20)
    engine.add_request("a", list(range(10)), max_tokens=8)
    runner.stop_after("a", 3)
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert len(tokens) == 3 and tokens[-1] == runner.eos_token_id
    assert reason is FinishReason.STOP


def test_a_long_prompt_is_chunked_and_its_first_chunk_takes_the_whole_prompt() -> None:
    engine, _ = make_engine(40, max_batch_tokens=8)
    req = engine.add_request("a", list(range(30)), max_tokens=2)
    engine.step()
    assert req.num_computed == 8 and req.held == 8  # 30 prompt tokens = 8 pages, all taken
    engine.step()
    engine.step()
    assert req.num_computed == 24 and req.held == 8 and not req.output
    engine.step()
    assert req.num_computed == 30 and len(req.output) == 1


def test_decode_rows_come_first_and_admission_spends_only_the_rest_of_the_budget() -> None:
    engine, _ = make_engine(60, max_batch_tokens=10)
    engine.add_request("a", list(range(9)), max_tokens=6)
    engine.step()  # a: 9 prompt tokens
    b = engine.add_request("b", list(range(50, 70)), max_tokens=2)
    batch = engine.sched.schedule(engine.steps)
    assert [(r.rid, len(r.token_ids)) for r in batch.rows] == [("a", 1), ("b", 9)]
    assert b.held == 5  # the whole 20-token prompt


def test_speculative_room_is_allocated_before_each_decode_step() -> None:
    model = tiny_model(speculative=2)
    engine, _ = make_engine(20, model=model)
    req = engine.add_request("a", list(range(4)), max_tokens=5)
    engine.step()  # prefill: 4 positions, one page; samples token 1
    assert req.held == 1
    engine.step()  # decode writes position 4 and drafts 5, 6: room for 7 positions
    assert req.held == 2
    finished, _ = drain(engine)
    assert req.held == 0 and finished["a"].finish_reason is FinishReason.LENGTH


def test_each_label_gets_what_count_pages_counts_and_an_unwritten_label_gets_none() -> None:
    slots = {"main": KvSlot(1, 1), "cfg": KvSlot(1, 1), "cross": KvSlot(fixed=10)}
    model = tiny_model(slots=slots)
    engine, _ = make_engine(40, model=model)
    image = engine.add_request("img", list(range(6)), max_tokens=3, extra_tokens={"main": 8})
    text = engine.add_request("txt", list(range(6)), max_tokens=3, labels=frozenset({"main"}))
    engine.step()
    assert {k: len(v) for k, v in image.pages.items()} == {"main": 4, "cfg": 2, "cross": 3}
    assert {k: len(v) for k, v in text.pages.items()} == {"main": 2}
    assert text.page_table("cfg") == [SINK_PAGE] and text.page_table("cross") == [SINK_PAGE]
    assert text.page_table("main") == text.pages["main"]
    worst = count_pages(model, RequestShape(6, 3, {"main": 8}))
    assert worst.per_label == {"main": 5, "cfg": 3, "cross": 3}
    drain(engine)


def test_the_prefix_cache_keys_only_labels_whose_tokens_are_the_prompt() -> None:
    slots = {"main": KvSlot(1, 1), "cross": KvSlot(fixed=10)}
    engine, _ = make_engine(40, model=tiny_model(slots=slots))
    engine.add_request("a", list(range(12)), max_tokens=2)
    drain(engine)
    assert len(engine.kv.index) == 0  # the cross label is not the prompt: nothing is keyed
    text, _ = make_engine(40, model=tiny_model(slots=slots))
    text.add_request("a", list(range(12)), max_tokens=2, labels=frozenset({"main"}))
    drain(text)
    assert len(text.kv.index) == 3


def test_bad_requests_are_rejected_with_a_reason_and_change_nothing() -> None:
    engine, _ = make_engine(10)
    with pytest.raises(RequestRejected, match="empty prompt"):
        engine.add_request("a", [])
    with pytest.raises(RequestRejected, match="max_tokens=0"):
        engine.add_request("a", [1], max_tokens=0)
    with pytest.raises(RequestRejected, match="max_tokens=-3"):
        engine.add_request("a", [1], max_tokens=-3)
    with pytest.raises(RequestRejected, match="no room for output"):
        engine.add_request("a", list(range(64)))
    expected = refusal(tiny_model(), RequestShape(30, 16), 10)
    assert expected is not None
    with pytest.raises(RequestRejected) as caught:
        engine.add_request("big", list(range(30)), max_tokens=16)
    assert expected.message in str(caught.value)
    assert caught.value.refusal == expected and caught.value.param == expected.param
    assert not engine.has_work() and engine.sched.stats.rejected == 1
    engine.add_request("a", [1, 2])
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("a", [3])


def test_abort_frees_a_running_request_and_cancels_a_waiting_one() -> None:
    engine, _ = make_engine(12)
    engine.add_request("a", list(range(20)), max_tokens=16)  # 9 pages: fills the ledger
    engine.add_request("b", list(range(20)), max_tokens=16)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.abort("b") and engine.abort("a")
    outs = engine.step()
    assert {(o.rid, o.finish_reason) for o in outs} == {
        ("a", FinishReason.ABORT),
        ("b", FinishReason.ABORT),
    }
    assert not engine.has_work() and engine.kv.pool.held == 0
    assert not engine.abort("a")


class LateClient(EmbeddedClient):
    """The embedded ledger behind a client that answers later, as a sidecar the step never
    waits on: the engine pins the head's hit and reports it (`pin`); `poll` decides at most
    `room` heads, each with the hit last pinned for it, and the engine reports each `start`."""

    def __init__(self, total_pages: int, debug: bool = False) -> None:
        super().__init__(embedded(total_pages, debug=debug).ledger)
        self.later = self
        self._hits: dict[str, Hit] = {}

    def pin(self, rid: str, pages: int, cost: int, exclusive: Mapping[str, int]) -> None:
        self._hits[rid] = Hit(pages, 0, 0)  # the next supply report carries the cost
        for held, count in exclusive.items():
            self.ledger.set_exclusive(held, count)

    def start(self, rid: str, prefill_chunks: int) -> None:
        self.ledger.start(rid, prefill_chunks)

    def cancel(self, rid: str) -> None:
        self._hits.pop(rid, None)
        super().cancel(rid)

    def collect(self) -> list[Decision]:
        return []  # decides only when polled

    def settled(self) -> bool:
        return True

    def poll(self, room: int) -> list[Decision]:
        decisions: list[Decision] = []
        ledger = self.ledger
        while room > 0 and (rid := ledger.head) is not None:
            admitted = ledger.try_admit(rid, self._hits.get(rid, NO_HIT))
            if admitted is None:
                break
            decisions.append(admitted)
            self._hits.pop(rid, None)
            room -= 1
        return decisions


class ResendingBackend(LateClient):
    """Delivers every decision twice, as a backend that retries would."""

    def poll(self, room: int) -> list[Decision]:
        decisions = super().poll(room)
        return decisions + decisions


def test_applying_an_admission_twice_is_harmless() -> None:
    backend = ResendingBackend(40)
    engine, _ = make_engine(40, backend=backend)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10 * i, 10 * i + 9)), max_tokens=3)
    finished, _ = drain(engine)
    assert len(finished) == 4 and engine.sched.stats.admitted == 4


def test_taking_past_the_reservation_raises() -> None:
    engine, _ = make_engine(40)
    req = engine.add_request("a", list(range(8)), max_tokens=4)
    engine.step()
    with pytest.raises(InvalidPages, match="reserved 3"):
        engine.policy.on_take(req, 2)


class OneStepLateBackend(LateClient):
    """Decides like the embedded ledger but hands each decision over one poll later, as a
    sidecar answering over the network would."""

    def __init__(self, total_pages: int) -> None:
        super().__init__(total_pages, debug=True)
        self._late: list[Decision] = []

    def poll(self, room: int) -> list[Decision]:
        ready, self._late = self._late, super().poll(room)
        return ready

    def settled(self) -> bool:
        return not self._late  # a decision on its way: the engine must not pin


def test_decisions_that_arrive_a_step_late_are_applied_safely() -> None:
    backend = OneStepLateBackend(24)
    engine, _ = make_engine(24, backend=backend, max_batch_tokens=16)
    shared = list(range(12))
    for i in range(6):
        engine.add_request(f"s{i}", [*shared, 40 + i], max_tokens=6)  # 3 cached pages each
        engine.add_request(f"u{i}", list(range(100 + 20 * i, 110 + 20 * i)), max_tokens=5)
    finished, _ = drain(engine)  # debug: the ledger agrees with the pool after every step
    assert len(finished) == 12
    assert all(o.finish_reason is FinishReason.LENGTH for o in finished.values())
    assert engine.sched.stats.preemptions == 0 and engine.sched.stats.hit_tokens > 0
    assert backend.outstanding() == 0 and engine.kv.pool.held == 0


@pytest.mark.parametrize("policy", ["banker", "peak+backfill", "no-evict"])
def test_a_request_is_counted_once_from_ingest_to_its_last_page(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[RequestShape] = []
    real = count_pages

    def counted(model, request, cached_pages=0):  # type: ignore[no-untyped-def]
        calls.append(request)
        return real(model, request, cached_pages)

    # Every module on the serving path that could count a request again.
    names = ("capacity.count", "capacity.refusal", "engine.engine", "engine.request")
    for name in names:
        monkeypatch.setattr(importlib.import_module(f"kvbank.{name}"), "count_pages", counted)
    engine, _ = make_engine(64, policy=policy)
    for i in range(5):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5][: i + 1], max_tokens=6)
    finished, _ = drain(engine)
    assert len(finished) == 5 and len(calls) == 5


class FailingRunner(VirtualRunner):
    """The virtual runner, with one request's row failing at its `at`-th sample, as a sampler
    reports a row it could not sample."""

    def __init__(self, rid: str, at: int) -> None:
        super().__init__()
        self.failing, self.at, self.samples = rid, at, 0

    def run(self, batch: StepBatch) -> StepResult:
        result = super().run(batch)
        if self.failing not in result.tokens:
            return result
        self.samples += 1
        if self.samples < self.at:
            return result
        tokens = {r: t for r, t in result.tokens.items() if r != self.failing}
        failure = RowFailure("the grammar gave up", "response_format")
        return replace(result, tokens=tokens, failed={self.failing: failure})


def test_a_row_that_fails_ends_only_its_request_and_frees_its_pages() -> None:
    runner = FailingRunner("bad", at=2)
    engine = Engine(EngineConfig(tiny_model(), 20, debug=True), runner)
    engine.add_request("bad", list(range(6)), max_tokens=6)
    engine.add_request("good", list(range(10, 16)), max_tokens=6)
    tokens: dict[str, int] = {"bad": 0, "good": 0}
    ends = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.rid] += len(out.new_token_ids)
            if out.finished:
                ends[out.rid] = out
    assert ends["bad"].finish_reason is FinishReason.ERROR
    assert (ends["bad"].message, ends["bad"].param) == ("the grammar gave up", "response_format")
    assert tokens == {"bad": 1, "good": 6}  # the failed row's step adds nothing to it
    assert ends["good"].finish_reason is FinishReason.LENGTH
    assert engine.kv.pool.held == 0 and engine.kv.supply == 19
