"""What one message on the sidecar's wire may carry, checked before anything of it is applied:
ids, label names and refusal messages of bounded length, no more labels than a ModelPool has,
and a pool and pace within a ModelPool's bounds (docs/limits.md).

A caller with the token may send anything up to --max-message-bytes. Without these bounds one
long id is paid again by every report that copies the ledger, every status reply that lists it
and every error message that quotes it (an error of more than 16 KiB reaches the client as
RESOURCE_EXHAUSTED, whatever its status), and a shape of thousands of labels costs every
admission test. What a shape's figures must satisfy is the shape's own rule
(`PeakShape.check`, applied by the ledger's submit); this module bounds only sizes."""

from __future__ import annotations

from kvbank.fields import quote
from kvbank.ledger import NEVER, InvalidPages
from kvbank.ledger.shape import MAX_LABEL_CHARS
from kvbank.modelpool import MAX_LABELS, MAX_PAGE_SIZE, MAX_PAGES, MAX_SPECULATIVE
from kvbank.proto import admission_pb2 as pb

# An engine's request ids are about 40 bytes ('chatcmpl-' and 32 hex digits, a sequence's
# index after them), follower ids a few ('rank-3'); 256 bytes leaves room for other engines'.
MAX_ID_BYTES = 256
# Decision sequence numbers a session may start from: one a decision from there on never
# passes int64 (a million decisions a second take 146,000 years to use up the rest).
MAX_SEQ = 1 << 62
# The engine's own refusal ("this request needs 9000 KV pages but the pool holds ...; lower
# max_tokens to at most ...") is about 200 bytes; the decision log keeps one per refusal.
MAX_REFUSAL_BYTES = 1024


def check_id(value: str, field: str) -> None:
    """An id of at most MAX_ID_BYTES bytes of UTF-8 (emptiness is the receiver's to refuse)."""
    if len(value) <= MAX_ID_BYTES // 4:
        return  # at most 4 bytes a character: short enough without encoding it
    size = len(value.encode())
    if size > MAX_ID_BYTES:
        raise InvalidPages(
            f"{field} is {size} bytes; an id is at most {MAX_ID_BYTES} bytes (an engine's are "
            f"about 40): send a shorter one, got {quote(value)}",
            field,
        )


def check_report(req: pb.ReportRequest) -> None:
    """Every id, label and refusal of a report within its bound, every shape and progress
    within MAX_LABELS labels, and every prefill bound one a timeline counts."""
    for i, event in enumerate(req.events):
        kind = event.WhichOneof("kind")
        if kind is None:
            continue  # apply_events names the event kinds
        body = getattr(event, kind)
        where = f"events[{i}].{kind}"
        if "rid" in body.DESCRIPTOR.fields_by_name:
            check_id(body.rid, f"{where}.rid")
        if kind == "submit":
            _check_text(body.refusal, MAX_REFUSAL_BYTES, f"{where}.refusal")
            check_id(body.hold, f"{where}.hold")
        if kind in ("submit", "give_back") and body.HasField("shape"):
            _check_shape(body.shape, f"{where}.shape")
        elif kind == "advance":
            _check_labels(list(body.tokens_per_label), f"{where}.tokens_per_label")
        elif kind == "start":
            _check_chunks(body.prefill_chunks, f"{where}.prefill_chunks")
        elif kind == "best_effort":
            for k, rid in enumerate(body.arrived):
                check_id(rid, f"{where}.arrived[{k}]")
    for i, question in enumerate(req.tries):
        check_id(question.rid, f"tries[{i}].rid")
        if question.HasField("prefill_chunks"):
            _check_chunks(question.prefill_chunks, f"tries[{i}].prefill_chunks")
    for rid in req.try_hits:
        check_id(rid, "try_hits key")
    for i, step in enumerate(req.progress):
        check_id(step.rid, f"progress[{i}].rid")
        _check_labels(list(step.tokens_per_label), f"progress[{i}].tokens_per_label")


def check_open(req: pb.OpenSessionRequest) -> None:
    """The engine's id and its running requests' ids within their bound, and a pool and pace
    a ModelPool could have (the bounds the timeline's arithmetic is exact within)."""
    check_id(req.engine_id, "engine_id")
    for i, running in enumerate(req.running):
        check_id(running.rid, f"running[{i}].rid")
    if req.next_seq > MAX_SEQ:
        raise InvalidPages(
            f"next_seq {req.next_seq} is past {MAX_SEQ}: decisions after it would not fit the "
            f"wire's int64; send the first sequence number the engine has not applied",
            "next_seq",
        )
    if req.total_pages > MAX_PAGES:
        raise InvalidPages(
            f"total_pages {req.total_pages} is past a ModelPool's {MAX_PAGES} pages; open the "
            f"session with the engine's own pool",
            "total_pages",
        )
    if req.HasField("pace"):
        pace = req.pace
        if pace.page_size > MAX_PAGE_SIZE or pace.speculative_tokens > MAX_SPECULATIVE:
            raise InvalidPages(
                f"pace page_size {pace.page_size} and speculative_tokens "
                f"{pace.speculative_tokens} must be at most a ModelPool's {MAX_PAGE_SIZE} and "
                f"{MAX_SPECULATIVE}",
                "pace.page_size" if pace.page_size > MAX_PAGE_SIZE else "pace.speculative_tokens",
            )


def _check_text(value: str, limit: int, field: str) -> None:
    size = len(value.encode())
    if size > limit:
        raise InvalidPages(
            f"{field} is {size} bytes; at most {limit} are kept: send a shorter one, got "
            f"{quote(value)}",
            field,
        )


def _check_shape(wire: pb.PeakShape, where: str) -> None:
    for name in ("labels", "base", "per_output", "worst"):
        count = len(getattr(wire, name))
        if count > MAX_LABELS:
            raise InvalidPages(
                f"{where}.{name} has {count} entries; a shape has one per label, and a model "
                f"at most {MAX_LABELS} labels",
                f"{where}.{name}",
            )
    _check_labels(list(wire.labels), f"{where}.labels")


def _check_labels(labels: list[str], field: str) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidPages(
            f"{field} names {len(labels)} labels; a model has at most {MAX_LABELS}", field
        )
    long = next((label for label in labels if len(label) > MAX_LABEL_CHARS), None)
    if long is not None:
        raise InvalidPages(
            f"{field}: a label is at most {MAX_LABEL_CHARS} characters, got {len(long)}: "
            f"{quote(long)}",
            field,
        )


def _check_chunks(value: int, field: str) -> None:
    if value > NEVER:
        raise InvalidPages(
            f"{field} {value} is more prefill steps than the ledger counts ({NEVER}); send "
            f"the request's worst-case prefill chunks",
            field,
        )
