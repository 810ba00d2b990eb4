"""The ledger's peak-fit hooks: the calls through which a policy ledger (kvbank.peaktimeline)
follows each running request step by step, so it can admit when the peak of the timeline fits
rather than the sum of worst cases. A ledger without a policy takes the same calls and only
checks that the request runs, so an engine reports progress the same way under every policy.

Deferred admissions: an engine that reads its decisions later (a sidecar's engine that does not
wait) starts each at a step the ledger cannot know. `admit_ready(deferred=True)` tests and keeps
those open-ended (kvbank.peaktimeline.open_ended) until the engine reports `start`, so no start
is ever late for the ledger."""

from __future__ import annotations

from collections.abc import Mapping

from kvbank.ledger_checks import LedgerChecks
from kvbank.ledger_state import Waiting
from kvbank.ledger_types import Hit, InvalidPages
from kvbank.peakfit import NEVER, PeakShape, flat_shape
from kvbank.peaktimeline import Hold, open_ended


def hold_of(hit: Hit) -> Hold:
    """What a leased hit holds, in the timeline's terms."""
    held = hit.pages - hit.idle_pages
    sole = held if hit.sole_pages is None else min(held, hit.sole_pages)
    return Hold(hit.pages, hit.idle_pages, sole)


class PeakHooks(LedgerChecks):
    """The peak-fit hooks mixed into `Ledger`."""

    def _shape(self, waiting: Waiting) -> PeakShape:
        assert self.policy is not None
        if waiting.shape is None:
            return flat_shape(waiting.pages, self.policy.page_size)
        return open_ended(waiting.shape) if self._deferring else waiting.shape

    def start(self, rid: str, prefill_chunks: int) -> None:
        """The engine started a request admitted with `deferred`; `prefill_chunks` is its
        worst-case prefill steps from now. A request the ledger does not follow step by step
        (no policy, no shape, restored) needs no start: the call only checks that it runs."""
        self.reservation(rid)
        self._check_pages(prefill_chunks, "prefill_chunks", bounded=False)
        timeline = self._timeline
        if timeline is None:
            return
        track = timeline.tracks[rid]
        if not timeline.is_unstarted(rid) and track.budget != NEVER:
            raise InvalidPages(
                f"request {rid!r} was started already (or admitted for an engine that starts "
                f"what it is told at once); report start only for deferred admissions"
            )
        timeline.start(rid, prefill_chunks)
        self._after_change()

    def set_exclusive(self, rid: str, exclusive: int) -> None:
        """A running request's pages no one else holds, counted by the pool after a pin or a
        lease shared some of them (a progress report carries the same count each step)."""
        res = self.reservation(rid)
        self._check_pages(exclusive, "exclusive")
        if exclusive > res.held:
            raise InvalidPages(
                f"request {rid!r} reports {exclusive} exclusive pages of the {res.held} it holds"
            )
        if self._timeline is not None:
            self._timeline.set_exclusive(rid, exclusive)
            self._after_change()

    @property
    def headroom(self) -> int:
        """Pages the pool could lose now (to a pin) with every admitted request still able to
        get every page it may need: supply minus the conservative outstanding, or, with a
        peak-fit policy, minus the timeline's highest extra demand."""
        timeline, policy = self._timeline, self.policy
        if timeline is None or policy is None or not policy.peak:
            return self.supply - self._outstanding
        highest, _ = timeline.peak()
        return self.supply + timeline.pending_return - highest

    def advance(
        self,
        rid: str,
        produced: int,
        tokens_per_label: Mapping[str, int] | None = None,
        chunks_left: int = 0,
        exclusive: int | None = None,
    ) -> None:
        """A running request's progress after a step: output tokens produced so far, tokens
        written per label (default: what `produced` implies), worst-case prefill chunks still
        to run, and, when the pool knows it, how many of its held pages no other request
        holds. A ledger without a policy only checks that the request runs."""
        self.reservation(rid)
        if self._timeline is None:
            return
        problem = self._timeline.check_advance(
            rid, produced, tokens_per_label, chunks_left, exclusive
        )
        if problem is not None:
            raise InvalidPages(problem)
        self._timeline.advance(rid, produced, tokens_per_label, chunks_left, exclusive)
        self._after_change()

    def end_step(self) -> list[str]:
        """Close a step; returns the running requests that did not advance in it (then the
        ledger admits conservatively until a step in which all of them advance)."""
        if self._timeline is None:
            return []
        stalled = self._timeline.end_step()
        if self.debug:
            self.check_integrity()
        return stalled

    @property
    def stalled_steps(self) -> int:
        """Steps in which some running request did not advance (peak-fit's assumption broke)."""
        return 0 if self._timeline is None else self._timeline.stalled_steps
