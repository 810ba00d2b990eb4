"""The descriptor bounds of `kvbank serve`: the connection cap under the open-files limit, and a
failed accept logged once per interval rather than as a traceback each time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvbank.engine.serve.http.limits import ACCEPT_MESSAGE, AcceptErrorLog, connection_cap


def test_the_cap_keeps_descriptors_for_the_model_and_the_sidecar() -> None:
    assert connection_cap(20000) == 20000 - 256
    assert connection_cap(512) == 256  # half of a small limit
    assert connection_cap(1) == 1


def test_a_failed_accept_is_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    handler = AcceptErrorLog(interval_s=10.0, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        context = {"message": ACCEPT_MESSAGE, "exception": OSError(24, "Too many open files")}
        with caplog.at_level(logging.ERROR, logger="kvbank.serve"):
            for _ in range(50):  # a flood: asyncio retries every second
                handler(loop, context)
                now[0] += 0.5
        lines = [r for r in caplog.records if r.name == "kvbank.serve"]
        # At t = 100, 110, 120: once per 10 s, each with the count since the last.
        assert len(lines) == 3
        assert all(r.exc_info is None for r in lines)  # no traceback
        assert "1 time(s)" in lines[0].getMessage() and "20 time(s)" in lines[1].getMessage()
        assert "Too many open files" in lines[0].getMessage()
    finally:
        loop.close()


def test_other_loop_errors_go_to_the_default_handler(caplog: pytest.LogCaptureFixture) -> None:
    handler = AcceptErrorLog()
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR):
            handler(loop, {"message": "something else"})
        assert any("something else" in r.getMessage() for r in caplog.records)
        assert handler.failed == 0
    finally:
        loop.close()
