"""The wire forms of what the sidecar's ledger reads and answers: the ledger's mode and pace
(`peak_policy`, `pace_of`), a request's shape and a cached hit, each checked as it comes off the
wire (every number non-negative, one entry per label, within the bounds the ledger needs); and
the submit event, a report, and the ledger's own errors as the engine's client sends and raises
them."""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.ledger import (
    NO_HIT,
    DuplicateRequest,
    Hit,
    InvalidPages,
    InvariantBreach,
    PeakPolicy,
    PeakShape,
    UnknownRequest,
)
from kvbank.mode import AdmissionMode
from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarError


def peak_policy(policy: str, pace: pb.LedgerPace | None) -> PeakPolicy | None:
    """The ledger's PeakPolicy for the mode `policy` names (kvbank/mode.py) with the engine's
    pace (None: the banker, which follows no progress)."""
    try:
        mode = AdmissionMode.parse(policy)
    except ValueError as exc:
        raise InvalidPages(f"OpenSession names no ledger policy: {exc}") from None
    if not mode.follows_progress:
        return None
    if pace is None:
        raise InvalidPages(
            f"the {policy} policy needs the engine's pace (page_size, speculative_tokens, "
            f"backfill_depth) in OpenSession"
        )
    max_advance = pace.max_advance if pace.HasField("max_advance") else None
    try:
        return PeakPolicy(
            pace.page_size,
            pace.speculative_tokens,
            mode.peak,
            mode.backfill,
            backfill_depth=pace.backfill_depth,
            max_advance=max_advance,
        )
    except ValueError as exc:
        raise InvalidPages(f"bad ledger pace: {exc}") from None


def pace_of(peak: PeakPolicy) -> pb.LedgerPace:
    pace = pb.LedgerPace(
        page_size=peak.page_size,
        speculative_tokens=peak.speculative_tokens,
        backfill_depth=peak.backfill_depth,
    )
    if peak.max_advance is not None:
        pace.max_advance = peak.max_advance
    return pace


def shape_to_wire(shape: PeakShape) -> pb.PeakShape:
    return pb.PeakShape(
        labels=shape.labels,
        base=shape.base,
        per_output=shape.per_output,
        worst=shape.worst,
        output_budget=shape.output_budget,
        prefill_chunks=shape.prefill_chunks,
    )


def shape_from_wire(rid: str, wire: pb.PeakShape, pages: int) -> PeakShape:
    """Every number checked: non-negative, one entry per label, base within worst."""
    n = len(wire.base)
    counts = (len(wire.per_output), len(wire.worst), len(wire.labels) or n)
    if not n or any(c != n for c in counts):
        raise InvalidPages(
            f"request {rid!r}: a shape needs one entry per label in base ({n}), per_output, "
            f"worst and labels, got {counts}"
        )
    if len(set(wire.labels)) != len(wire.labels):
        raise InvalidPages(f"request {rid!r}: shape labels repeat: {list(wire.labels)}")
    numbers = [*wire.base, *wire.per_output, *wire.worst, wire.output_budget, wire.prefill_chunks]
    if min(numbers) < 0:
        raise InvalidPages(f"request {rid!r}: shape numbers must be non-negative, got {numbers}")
    bad = [(b, w) for b, w in zip(wire.base, wire.worst, strict=True) if b > w]
    if bad:
        raise InvalidPages(f"request {rid!r}: shape base tokens exceed worst tokens: {bad}")
    return PeakShape(
        tuple(wire.base),
        tuple(wire.per_output),
        tuple(wire.worst),
        wire.output_budget,
        wire.prefill_chunks,
        pages,
        tuple(wire.labels),
    )


def hit_from_wire(rid: str, h: pb.Hit) -> Hit:
    held = h.pages - h.idle_pages
    sole = h.sole_pages if h.HasField("sole_pages") else None
    if not 0 <= h.idle_pages <= h.pages or (sole is not None and not 0 <= sole <= held):
        raise InvalidPages(
            f"hit of {rid!r} must satisfy 0 <= idle_pages {h.idle_pages} <= pages {h.pages} "
            f"and 0 <= sole_pages {sole} <= pages - idle_pages {held}"
        )
    return Hit(h.pages, h.idle_pages, sole) if h.pages else NO_HIT


def hit_to_wire(hit: Hit) -> pb.Hit:
    wire = pb.Hit(pages=hit.pages, idle_pages=hit.idle_pages)
    if hit.sole_pages is not None:
        wire.sole_pages = hit.sole_pages
    return wire


_LEDGER_ERRORS: dict[str, type[Exception]] = {
    "INVALID_ARGUMENT": InvalidPages,
    "NOT_FOUND": UnknownRequest,
    "ALREADY_EXISTS": DuplicateRequest,
    "INTERNAL": InvariantBreach,
}


def submit_to_wire(rid: str, pages: int, refusal: str, shape: pb.PeakShape | None) -> pb.Submit:
    """A submit event, as `submit` queues it and a re-opened session resends it."""
    submit = pb.Submit(rid=rid, pages=pages, refusal=refusal)
    if shape is not None:
        submit.shape.CopyFrom(shape)
    return submit


def as_ledger_error(exc: SidecarError) -> Exception:
    """The ledger's own error for a status the sidecar mapped from one, so an engine handles a
    remote ledger's refusal as it would the embedded one's; other errors pass unchanged."""
    kind = _LEDGER_ERRORS.get(exc.code)
    return kind(exc.message) if kind is not None else exc


@dataclass(frozen=True)
class Report:
    """A report as the engine's step leaves it (sidecar/backend_wire.py `ReportWire.build`):
    its events, already wire messages, and plain values. `to_wire` makes the message; a serving
    engine's sender thread does, off the step. `tries` given: the questions of an engine that
    waits for the answers (`in_step`); else, to `admit`, the first `try_first` waiting requests
    with `hits`."""

    session: int
    report_seq: int
    applied_seq: int
    events: list[pb.Event]
    admit: bool
    room: int
    tries: list[pb.Try] | None = None
    try_first: int = 0
    hits: dict[str, Hit] | None = None

    def to_wire(self) -> pb.ReportRequest:
        in_step = self.tries is not None
        request = pb.ReportRequest(
            session=self.session,
            report_seq=self.report_seq,
            applied_seq=self.applied_seq,
            events=self.events,
            tries=self.tries,
            admit=self.admit,
            in_step=in_step,
        )
        if not in_step:
            request.room = self.room
            if self.try_first:
                request.try_first = self.try_first
                for rid, hit in (self.hits or {}).items():
                    request.try_hits[rid].CopyFrom(hit_to_wire(hit))
        return request
