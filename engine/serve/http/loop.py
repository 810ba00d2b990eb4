"""The engine loop: one thread owns the Engine and calls `step()`; HTTP handlers talk to it only
through commands and per-request queues.

Handlers never touch the engine: `submit` and `abort` post a command that the loop applies
between steps (so a request is either fully queued or not at all), and each request's outputs
come back on an asyncio queue in the handler's event loop. The loop never waits on admission:
the engine's backend answers without blocking, and an idle loop sleeps on a wake-up event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from kvbank.engine.engine import Engine, RequestOutput
from kvbank.engine.runner import SamplingParams
from kvbank.service_class import ServiceClass

log = logging.getLogger("kvbank.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound; nothing was queued."""

    def __init__(self, waiting: int, bound: int) -> None:
        super().__init__(
            f"the waiting queue holds {waiting} requests, its bound (--max-waiting) is {bound}; "
            f"retry later"
        )


class EngineStopped(Exception):
    """The engine loop has stopped (shutdown, or a fatal error); no request can run."""


class AdmissionUnavailable(Exception):
    """The engine's admission sidecar does not answer: nothing can be admitted now, so nothing
    is queued (a request would wait on a ledger the engine cannot reach)."""

    def __init__(self, outage: Outage) -> None:
        super().__init__(f"{outage.describe()}; retry later, or on another replica")
        self.outage = outage


class Outage(Protocol):
    """What a backend that can lose its ledger says about it (kvbank.sidecar.backend_wire)."""

    since: float

    def describe(self) -> str: ...


@dataclass
class Submission:
    rid: str
    prompt: list[int]
    max_tokens: int | None
    sampling: SamplingParams
    outputs: asyncio.Queue[RequestOutput]
    event_loop: asyncio.AbstractEventLoop
    # More sequences from the same prompt (n > 1), each streaming to its own queue; the engine
    # admits them with this one (kvbank.engine.sequences).
    siblings: tuple[Submission, ...] = ()
    service_class: ServiceClass | None = None  # what the client asked; None: the pool's default
    # What the engine granted (strict whenever its KV cannot be rebuilt), set once it is queued.
    granted: ServiceClass | None = None


StepHook = Callable[[Engine, list[RequestOutput]], None]


class EngineLoop:
    IDLE_WAIT_S = 0.5  # an idle loop wakes at least this often (shutdown, hooks)
    EMPTY_STEP_WAIT_S = 0.002  # waiting requests but no rows: let the backend decide

    def __init__(
        self,
        engine: Engine,
        max_waiting: int,
        on_step: StepHook | None = None,
        step_fn: Callable[[], list[RequestOutput]] | None = None,
        idle_fn: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step
        # Tensor parallelism replaces the plain step with one that agrees with the followers.
        self._step = step_fn or engine.step
        self._idle = idle_fn  # called on every idle turn (a TP heartbeat)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, Submission] = {}
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._busy = False

    # ---- called from HTTP handlers (any thread) -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def submit(self, sub: Submission) -> None:
        """Queue a request, or raise: RequestRejected (400), QueueFull (429), EngineStopped."""
        # The timeout only guards a loop that died between the check and the command.
        await asyncio.wait_for(asyncio.wrap_future(self._call(lambda: self._add(sub))), 60)

    def abort(self, rid: str) -> None:
        """Abort a request (client gone, or a stop string seen); no answer awaited."""
        if self.alive:
            self._call(lambda: self._abort(rid))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run fn on the engine thread between steps (for reading figures consistently)."""
        return self._call(fn)

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        if not self.alive:
            future.set_exception(EngineStopped("the engine loop is not running"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    # ---- the engine thread ----------------------------------------------------------------------

    @property
    def outage(self) -> Outage | None:
        """Why admission cannot run now (the sidecar is unreachable); None while it can. Read
        from any thread: the backend replaces one reference."""
        outage: Outage | None = getattr(self.engine.backend, "outage", None)
        return outage

    def _add(self, sub: Submission) -> None:
        outage = self.outage
        if outage is not None:
            raise AdmissionUnavailable(outage)
        waiting = self.engine.num_waiting
        if waiting >= self.max_waiting:
            raise QueueFull(waiting, self.max_waiting)
        siblings = [(other.rid, other.sampling) for other in sub.siblings]
        req = self.engine.add_request(
            sub.rid,
            sub.prompt,
            sub.max_tokens,
            sampling=sub.sampling,
            siblings=siblings,
            service_class=sub.service_class,
        )
        sub.granted = req.service_class
        self._streams[sub.rid] = sub
        self._streams.update((other.rid, other) for other in sub.siblings)

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def _drain(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # the caller's error (a rejection), handed back to it
                future.set_exception(exc)

    def _main(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain()
                if not self.engine.has_work():
                    self._idle_step()
                    continue
                self._busy = True
                outputs = self._step()
                self._deliver(outputs)
                self._refuse_waiting_without_admission()
                if self.on_step:
                    self.on_step(self.engine, outputs)
                if self.engine.last_rows == 0:
                    self._wake.wait(self.EMPTY_STEP_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:
            self.error = exc
            log.exception("the engine loop stopped")
        finally:
            self._fail_all()

    def _refuse_waiting_without_admission(self) -> None:
        """With admission lost, every waiting request ends now with the outage as its error
        (HTTP 503 to a client still waiting for its headers), rather than wait for a sidecar
        that may not come back; what runs keeps its pages and finishes."""
        outage = self.outage
        if outage is None or not self.engine.num_waiting:
            return
        message = str(AdmissionUnavailable(outage))
        for rid in list(self.engine.sched.waiting_by_rid):
            sub = self._streams.pop(rid, None)
            subs = [] if sub is None else [sub, *sub.siblings]
            for seq in subs:
                self._streams.pop(seq.rid, None)
                self.engine.abort(seq.rid)
                out = RequestOutput(seq.rid, [], True, None, message)
                seq.event_loop.call_soon_threadsafe(seq.outputs.put_nowait, out)
            if sub is None:
                self.engine.abort(rid)

    def _idle_step(self) -> None:
        # A sidecar backend sends only while polled: an idle engine still pushes its last
        # events out, keeps its session and finds a lost sidecar again, without waiting.
        idle = getattr(self.engine.backend, "idle", None)
        wait_s = self.IDLE_WAIT_S
        if idle is not None:
            wait_s = min(wait_s, idle())
        elif self._busy:
            flush = getattr(self.engine.backend, "flush", None)
            if flush is not None:
                flush()
        self._busy = False
        if self._wake.wait(wait_s):
            self._wake.clear()
        if self._idle:
            self._idle()
        if self.on_step:
            self.on_step(self.engine, [])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sub = self._streams.get(out.rid)
            if sub is None:
                continue
            if out.finished:
                del self._streams[out.rid]
            sub.event_loop.call_soon_threadsafe(sub.outputs.put_nowait, out)

    def _fail_all(self) -> None:
        """Wake every waiting handler and refuse queued commands: nothing waits forever."""
        for rid, sub in list(self._streams.items()):
            out = RequestOutput(rid, [], True, None, "the engine stopped")
            with contextlib.suppress(RuntimeError):  # that event loop may be closed already
                sub.event_loop.call_soon_threadsafe(sub.outputs.put_nowait, out)
        self._streams.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine loop stopped"))
