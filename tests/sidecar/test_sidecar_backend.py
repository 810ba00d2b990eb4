"""The engine's gRPC backend against a real sidecar: its registry, the supply it forwards, and a
cancel that crosses an admission."""

from __future__ import annotations

import time

from kvbank.ledger import Admitted, Hit
from kvbank.sidecar.backend import SidecarBackend
from kvbank.sidecar.client import SidecarClient


def test_a_repeated_supply_after_a_take_still_reaches_the_ledger(client: SidecarClient) -> None:
    backend = SidecarBackend(client, 101)
    backend.set_supply(100, 0)
    backend.submit("a", 10)
    backend.submit("b", 10)
    assert [(d.rid, d.seq) for d in backend.poll(2)] == [("a", 0), ("b", 1)]
    backend.take("b", 3)
    backend.set_supply(97, 0)
    backend.take("a", 3)  # the ledger now counts free 94
    backend.release("b")
    backend.set_supply(97, 0)  # the pool has 97 again: b's pages returned
    backend.check_integrity(97, 0)  # flushes, then compares the sidecar's figures
    assert backend.last_pool is not None
    assert (backend.last_pool.free, backend.last_pool.outstanding) == (97, 7)
    assert backend.outstanding() == 7


def test_a_cancel_after_the_admission_was_decided_sends_nothing(client: SidecarClient) -> None:
    backend = SidecarBackend(client, 101, blocking=True)
    backend.submit("a", 10)
    backend.pin("a", 2, 0, {})
    (decision,) = backend.poll(1)
    assert decision == Admitted("a", 0, 10, Hit(2, 0, 0))
    backend.cancel("a")  # too late: the engine releases it when it applies the admission
    backend.release("a")
    backend.check_integrity(100, 0)
    status = client.status()
    assert (status.running, status.waiting, status.outstanding) == (0, 0, 0)


def test_room_limits_each_poll_like_the_embedded_backend(client: SidecarClient) -> None:
    backend = SidecarBackend(client, 101)
    for rid in ("a", "b", "c"):
        backend.submit(rid, 10)
    assert [d.rid for d in backend.poll(0)] == []
    assert [d.rid for d in backend.poll(2)] == ["a", "b"]
    assert [d.rid for d in backend.poll(5)] == ["c"]
    assert backend.outstanding() == 30


def test_flush_on_idle_keeps_a_live_engines_session(client: SidecarClient) -> None:
    backend = SidecarBackend(client, 101, blocking=False, lease_s=0.3)
    backend.submit("a", 10)
    deadline = time.monotonic() + 5
    while not backend.collect():  # the engine reads a reply at the start of a step ...
        backend.poll(1)  # ... and sends the next report after it
        assert time.monotonic() < deadline
    session = client.status().session
    for _ in range(10):  # an idle engine loop: 1 s, over three leases
        backend.flush()
        time.sleep(0.1)
    assert client.status().session == session
    assert backend.sessions_opened == 1
    time.sleep(0.6)  # no flush: the lease runs out, the reservation goes with it
    status = client.status()
    assert (status.session, status.reserved) == (0, 0)
    backend.release("a")
    backend.flush()  # the next report finds its session gone and re-opens one
    assert backend.sessions_opened == 2
    assert client.status().running == 0
