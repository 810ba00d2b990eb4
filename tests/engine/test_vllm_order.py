"""kvbank.vllm.order without vLLM: the queue it keeps in step with the real embedded ledger's,
the aging bound that keeps any request from waiting behind later ones for ever, and fifo."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvbank.ledger.client import embedded
from kvbank.vllm.order import REORDER_WINDOW, FifoOrder, PrefixOrder, make_order


@dataclass
class Request:
    """What the order reads of a vLLM request."""

    block_hashes: list[int] = field(default_factory=list)


@dataclass
class Entry:
    request: Request


def queue(order: PrefixOrder, backend, prefixes: dict[str, int | None]) -> OrderedDict:
    waiting = OrderedDict()
    for rid, prefix in prefixes.items():
        waiting[rid] = Request([] if prefix is None else [prefix, 99])
        backend.submit(rid, 4)
        order.queued(rid, 4, None)
    return waiting


def ledger_order(backend) -> list[str]:
    return [rid for rid, _ in backend.ledger.snapshot().waiting]


def test_requests_of_no_held_prefix_go_behind_in_both_queues() -> None:
    backend, order = embedded(64), PrefixOrder(max_defer_steps=100)
    waiting = queue(order, backend, {"b1": 2, "a1": 1, "b2": 2, "short": None, "a2": 1})
    running = [Entry(Request([1, 7]))]  # prefix 1 is held
    assert order.reorder(waiting, running, backend) == ["b1", "b2"]
    assert list(waiting) == ["a1", "short", "a2", "b1", "b2"] == ledger_order(backend)
    assert order.moved == 2
    # Already behind: nothing moves, and the ledger is not touched.
    assert order.reorder(waiting, running, backend) == []
    assert ledger_order(backend) == list(waiting)
    # Nothing running: no prefix is held, so arrival order among the rest stays as it is.
    assert order.reorder(waiting, [], backend) == []


def test_a_pass_looks_at_the_first_window_of_the_queue_only() -> None:
    """A long queue of cold requests: a pass costs at most REORDER_WINDOW moves, and a request
    of the held prefix past the window is not pulled forward."""
    running = [Entry(Request([1]))]
    cold = {f"c{i}": 1000 + i for i in range(REORDER_WINDOW + 20)}
    backend, order = embedded(4096), PrefixOrder(max_defer_steps=100)
    waiting = queue(order, backend, {**cold, "far": 1})
    assert order.reorder(waiting, running, backend) == []
    backend, order = embedded(4096), PrefixOrder(max_defer_steps=100)
    waiting = queue(order, backend, {"c0": 1000, "c1": 1001, "hot": 1, **cold})
    moved = order.reorder(waiting, running, backend)
    assert moved == [f"c{i}" for i in range(REORDER_WINDOW - 1)]  # the window's cold ones
    assert list(waiting)[:2] == ["hot", f"c{REORDER_WINDOW - 1}"]
    assert ledger_order(backend) == list(waiting)


def test_a_request_that_waited_max_defer_steps_keeps_its_place() -> None:
    backend, order = embedded(64), PrefixOrder(max_defer_steps=3)
    waiting = queue(order, backend, {"b1": 2, "a1": 1})
    running = [Entry(Request([1]))]
    assert order.reorder(waiting, running, backend) == ["b1"]  # pass 1
    waiting["a2"] = Request([1])
    backend.submit("a2", 4)
    order.queued("a2", 4, None)
    assert order.reorder(waiting, running, backend) == ["b1"]  # pass 2: behind a2 again
    waiting["a3"] = Request([1])
    backend.submit("a3", 4)
    order.queued("a3", 4, None)
    assert order.reorder(waiting, running, backend) == []  # pass 3: b1 has waited 3 passes
    assert list(waiting) == ["a1", "a2", "b1", "a3"] == ledger_order(backend)


def test_requests_that_left_are_forgotten() -> None:
    backend, order = embedded(64), PrefixOrder(max_defer_steps=100)
    waiting = queue(order, backend, {"b1": 2, "a1": 1})
    del waiting["a1"]
    backend.cancel("a1")
    assert order.reorder(waiting, [Entry(Request([1]))], backend) == []
    assert "a1" not in order._queued


def test_fifo_never_moves_anything() -> None:
    backend = embedded(64)
    order = make_order("fifo", 0)
    assert isinstance(order, FifoOrder)
    waiting = OrderedDict(b1=Request([2]), a1=Request([1]))
    assert order.reorder(waiting, [Entry(Request([1]))], backend) == []
    assert list(waiting) == ["b1", "a1"]
    assert isinstance(make_order("prefix", 5), PrefixOrder)
