"""The peak-fit ledger in the sidecar: its mode, the wire forms of what it reads, and the
stepwise admission pass.

A peak-fit pass (`Ledger.admissions`) asks the engine for each candidate's hit in turn, and
the answer depends on what the engine started before the question (a started request leases
pages, so a later candidate's idle and sole pages change, and so does its prefill bound). The
engine cannot be called back, so the pass runs as a conversation of reports: the reply names the
candidate (`peek`), the engine starts what was admitted and answers in the next report
(`resume`, with the takes of those starts as events). The sidecar keeps the ledger as it was
when the pass opened plus every answer so far, and replays the pass on a copy each round until
it asks for an answer it does not have. A replay makes the same decisions with the same sequence
numbers (the ledger is deterministic), so what an earlier round told the engine stands. Cost:
O(answers) ledger work a round, so a pass of n questions costs O(n^2); n is at most the heads
that start in one step plus the backfill depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvbank.ledger import NO_HIT, Admitted, Hit, InvalidPages, Ledger, PeakPolicy, PeakShape
from kvbank.mode import AdmissionMode
from kvbank.proto import admission_pb2 as pb


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


class NeedHit(Exception):
    """The pass asked for a candidate the engine has not answered yet."""

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.rid = rid


@dataclass
class Answer:
    takes: list[pb.Take]  # what the engine's starts took since the previous question
    head: pb.HeadHit


@dataclass
class OpenPass:
    """A pass in progress: the ledger when it opened, the answers so far, and how many of its
    decisions the engine was already told."""

    base: Ledger
    answers: list[Answer] = field(default_factory=list)
    told: int = 0
    asked: str = ""

    def replay(self) -> tuple[Ledger, list[Admitted], str]:
        """Run the pass on a copy: the ledger, the admissions made, and the candidate whose
        hit it needs next ("" when the pass is over)."""
        ledger = self.base.copy()
        admitted: list[Admitted] = []
        answers = iter(self.answers)

        def peek(rid: str) -> Hit | None:
            answer = next(answers, None)
            if answer is None:
                raise NeedHit(rid)
            return _answer(ledger, rid, answer)

        try:
            ledger.admit_ready(peek, admitted.append)
        except NeedHit as need:
            return ledger, admitted, need.rid
        return ledger, admitted, ""


def _answer(ledger: Ledger, rid: str, answer: Answer) -> Hit | None:
    head = answer.head
    if head.rid != rid:
        raise InvalidPages(
            f"the pass asked for the hit of {rid!r} but the answer is for {head.rid!r}"
        )
    for take in answer.takes:
        ledger.take(take.rid, take.pages)
    if head.stop:
        return None
    if head.HasField("prefill_chunks"):
        shape = ledger.shape(rid)
        if shape is not None and shape.prefill_chunks != head.prefill_chunks:
            ledger.set_shape(rid, replace(shape, prefill_chunks=head.prefill_chunks))
    return hit_from_wire(rid, head.hit)


def check_answer(req: pb.ReportRequest, asked: str) -> Answer:
    """A resume report carries takes only, and exactly one answer: for the candidate asked."""
    if len(req.hits) != 1 or req.hits[0].rid != asked:
        got = [h.rid for h in req.hits]
        raise InvalidPages(f"a resume report answers the pass's question {asked!r}; got {got}")
    head = req.hits[0]
    if head.HasField("prefill_chunks") and head.prefill_chunks < 0:
        raise InvalidPages(f"prefill_chunks of {asked!r} must be >= 0, got {head.prefill_chunks}")
    if not head.stop:
        hit_from_wire(asked, head.hit)
    takes = []
    for event in req.events:
        if not event.HasField("take"):
            raise InvalidPages(
                f"a resume report carries only the takes of the requests it started, got a "
                f"{event.WhichOneof('kind')} event"
            )
        takes.append(event.take)
    return Answer(takes, head)
