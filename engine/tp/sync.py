"""How tensor-parallel ranks stay in step: rank 0 decides, followers replay, all ranks agree.

Every engine step is one exchange over the process group, in the same order on every rank:

1. rank 0 broadcasts a `Plan` (sequence-numbered): the requests it added and aborted since the
   last step, in order, and the admission decisions its backend returned at each `poll` of this
   step. A follower applies the same adds and aborts, then steps its own engine with a
   `FollowerBackend` that hands its ledger policy exactly rank 0's answers, in order.
   The answers are those rank 0's backend gave (to each in-step question, each poll, the pin
   budget): one strategy under every mode, whether rank 0's ledger is its own or its sidecar's.
2. every rank all-gathers a digest of the batch it scheduled (or of the error it hit). Any
   difference raises `TPDiverged` on every rank at once, with each rank's digest in the message:
   no rank asserts alone and none is left waiting in a collective.
3. the forward pass runs (its all-reduces are the model's), and rank 0 broadcasts the sampled
   tokens, so followers append exactly rank 0's tokens.

An idle rank 0 sends a heartbeat plan every loop turn, so a dead peer is noticed within the
process group's timeout even with no traffic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from kvbank.engine.runner import SamplingParams, StepBatch, StepResult
from kvbank.ledger import Admitted, Decision, Hit, PeakShape
from kvbank.ledger.client import BestEffortFigures, LateAnswers, LedgerClient, StepEnd
from kvbank.service_class import ServiceClass

IDLE = "idle"
NO_ROWS = "no rows"


class TPDiverged(RuntimeError):
    """The ranks disagree (a batch, a decision, an error on one of them): every rank stops."""


@dataclass(frozen=True)
class Added:
    rid: str
    prompt: list[int]
    max_tokens: int | None
    sampling: SamplingParams | None
    siblings: tuple[tuple[str, SamplingParams], ...] = ()  # the other sequences (n > 1)
    service_class: ServiceClass | None = None  # as asked; each rank derives the same class


@dataclass
class Plan:
    seq: int
    kind: str = "step"  # "step", "idle" (heartbeat), "stop" (rank 0 shuts down), "error"
    journal: list[Added | str] = field(default_factory=list)  # adds, and aborted request ids
    polls: list[Answer] = field(default_factory=list)  # rank 0's backend's answers, in order
    message: str = ""


def batch_digest(batch: StepBatch) -> str:
    h = hashlib.sha1()
    for row in batch.rows:
        h.update(repr((row.rid, list(row.token_ids), row.start_pos, list(row.page_ids),
                       row.sample)).encode())  # fmt: skip
    if batch.moves:  # the host tier's copies: every rank must evict and reload alike
        h.update(repr([(m.direction.value, m.page, m.slot) for m in batch.moves]).encode())
    return f"{len(batch.rows)} rows, {batch.num_tokens} tokens, {h.hexdigest()[:12]}"


class Channel:
    """The control messages of one TP group over the default process group (gloo on CPU)."""

    def __init__(
        self, rank: int, world: int, startup_barrier: Callable[[], None] = lambda: None
    ) -> None:
        self.rank = rank
        self.world = world
        self.exchanges = 0
        self.startup_barrier = startup_barrier  # every rank loaded; collectives may start

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, digest: str, seq: int) -> None:
        """All-gather each rank's digest; raise TPDiverged on every rank if any differ."""
        self.exchanges += 1
        digests: list[Any] = [None] * self.world
        dist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            lines = "; ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
            raise TPDiverged(
                f"tensor-parallel ranks diverged at plan {seq}: {lines}. Every rank stops; "
                f"restart the group (a follower must run exactly rank 0's batch)"
            )


@dataclass(frozen=True)
class Headroom:
    """Rank 0's pin budget at a step (a peak-fit follower pins with the same one)."""

    pages: int


@dataclass(frozen=True)
class Tried:
    """Rank 0's answer to one in-step question (`try_admit`), and whether backfilling went on."""

    rid: str
    decision: Admitted | None
    backfilling: bool


# One answer of rank 0's backend, in call order: decisions (poll, collect), settled(),
# headroom(), and the answers to the questions it asked in step.
Answer = list[Decision] | bool | Headroom | Tried


class RecordingBackend:
    """Rank 0's backend: the real one (embedded ledger or sidecar), with each answer a
    follower must replay recorded for the step's plan: decisions, whether admission was
    settled, and (peak-fit over a sidecar) the pin budget. The peak-fit events pass through."""

    def __init__(self, inner: LedgerClient) -> None:
        self.inner = inner
        self.polls: list[Answer] = []

    def __getattr__(self, name: str) -> Any:
        # The peak-fit backend's own events (configure, advance, start, ...) need no record:
        # every rank makes the same calls, and only the answers above differ in time.
        return getattr(self.inner, name)

    @property
    def later(self) -> RecordingBackend | None:
        """Itself when rank 0's client answers later: its late answers are recorded too."""
        return self if self.inner.later is not None else None

    def _late(self) -> LateAnswers:
        late = self.inner.later
        assert late is not None, "asked for a late answer of a client that answers in step"
        return late

    def headroom(self) -> int:
        pages = int(self.inner.headroom())  # type: ignore[attr-defined]
        self.polls.append(Headroom(pages))
        return pages

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None:
        decision = self.inner.try_admit(rid, hit, prefill_chunks)
        self.polls.append(Tried(rid, decision, self.inner.backfilling()))
        return decision

    def backfilling(self) -> bool:
        last = self.polls[-1] if self.polls else None
        return isinstance(last, Tried) and last.backfilling

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
        return False  # every question is asked, so the followers replay the same answers

    def take_polls(self) -> list[Answer]:
        polls, self.polls = self.polls, []
        return polls

    def poll(self, room: int) -> list[Decision]:
        decisions = self._late().poll(room)
        self.polls.append(list(decisions))
        return decisions

    def collect(self) -> list[Decision]:
        decisions = self._late().collect()
        self.polls.append(list(decisions))
        return decisions

    def settled(self) -> bool:
        # Whether rank 0 pins depends on its sidecar's timing: the followers replay the answer.
        answer = self._late().settled()
        self.polls.append(answer)
        return answer

    def start(self, rid: str, prefill_chunks: int) -> None:
        self._late().start(rid, prefill_chunks)

    def submit(
        self, rid: str, pages: int, refusal: str | None = None, shape: PeakShape | None = None
    ) -> None:
        if shape is None:
            self.inner.submit(rid, pages, refusal)
        else:
            self.inner.submit(rid, pages, refusal, shape=shape)  # type: ignore[call-arg]

    def cancel(self, rid: str) -> None:
        self.inner.cancel(rid)

    def pin(self, rid: str, pages: int, cost: int, exclusive: Mapping[str, int]) -> None:
        self._late().pin(rid, pages, cost, exclusive)

    def take(self, rid: str, pages: int) -> None:
        self.inner.take(rid, pages)

    def release(self, rid: str) -> None:
        self.inner.release(rid)

    def give_back(self, rid: str, held: int, reserved: int, shape: PeakShape | None = None) -> None:
        self.inner.give_back(rid, held, reserved, shape)

    def set_supply(
        self, free: int, evictable: int, best_effort: BestEffortFigures | None = None
    ) -> None:
        self.inner.set_supply(free, evictable, best_effort)

    def outstanding(self) -> int:
        return self.inner.outstanding()

    def flush(self) -> None:
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()

    def check_integrity(self, free: int, evictable: int) -> None:
        self.inner.check_integrity(free, evictable)


class FollowerBackend:
    """A follower's backend under every ledger mode, rank 0's ledger its own or its sidecar's
    (`late`: rank 0's client answers later, so this one has `later` too): it decides nothing
    and keeps no ledger. It replays
    rank 0's answers in order (the answers to its questions, decisions, settled, the pin budget), so
    the follower's policy asks, pins, starts and reports exactly as rank 0's did; its events go
    nowhere. A follower asking what rank 0 did not ask has diverged."""

    def __init__(self, late: bool) -> None:
        self.later = self if late else None
        self._planned: list[Answer] = []
        self._backfilling = False

    def expect(self, polls: list[Answer]) -> None:
        left = [d for batch in self._planned if isinstance(batch, list) for d in batch]
        if left:
            raise TPDiverged(f"decisions of rank 0 were never applied here: {left}")
        self._planned = list(polls)

    def _next(self, kind: type) -> Answer:
        answer = self._planned.pop(0) if self._planned else None
        if type(answer) is not kind:
            raise TPDiverged(
                f"this rank asked for a {kind.__name__} answer where rank 0's next was {answer!r}"
            )
        assert answer is not None
        return answer

    def try_admit(
        self, rid: str, hit: Hit | None, prefill_chunks: int | None = None
    ) -> Admitted | None:
        answer = self._next(Tried)
        assert isinstance(answer, Tried)
        if answer.rid != rid:
            raise TPDiverged(f"this rank asked about {rid!r} where rank 0 asked {answer.rid!r}")
        self._backfilling = answer.backfilling
        return answer.decision

    def backfilling(self) -> bool:
        return self._backfilling

    def refuses_behind(self, rid: str, most_held: int, prefill_chunks: int | None) -> bool:
        return False  # rank 0 asked every question

    def poll(self, room: int) -> list[Decision]:
        return self._next(list) if self._planned else []  # type: ignore[return-value]

    def collect(self) -> list[Decision]:
        return self.poll(0)

    def settled(self) -> bool:
        return bool(self._next(bool))

    def headroom(self) -> int:
        answer = self._next(Headroom)
        assert isinstance(answer, Headroom)
        return answer.pages

    def submit(self, *args: Any, **kwargs: Any) -> None: ...
    def configure(self, *args: Any) -> None: ...
    def cancel(self, rid: str) -> None: ...
    def pin(self, rid: str, pages: int, cost: int, exclusive: Mapping[str, int]) -> None: ...
    def take(self, rid: str, pages: int) -> None: ...
    def release(self, rid: str) -> None: ...
    def give_back(self, *args: Any) -> None: ...
    def set_supply(self, *args: Any) -> None: ...
    def advance(self, *args: Any) -> None: ...
    def start(self, rid: str, prefill_chunks: int) -> None: ...
    def check_integrity(self, free: int, evictable: int) -> None: ...

    def end_step(self) -> StepEnd:
        return StepEnd([], 0)

    def outstanding(self) -> int:
        return 0


class LeaderRunner:
    """Rank 0's runner: before the forward pass it sends the step's plan and agrees on the
    batch; after it, it sends the sampled tokens."""

    def __init__(self, inner: Any, channel: Channel, make_plan: Callable[[str], Plan]) -> None:
        self.inner = inner
        self.channel = channel
        self.make_plan = make_plan
        self.eos_token_id: int = inner.eos_token_id
        self.synced = False

    def run(self, batch: StepBatch) -> StepResult:
        plan = self.make_plan("step")
        self.channel.broadcast(plan)
        self.synced = True
        self.channel.agree(batch_digest(batch), plan.seq)
        result: StepResult = self.inner.run(batch)
        self.channel.broadcast((result.tokens, result.failed))  # a failed row ends on every rank
        return result

    def release(self, rid: str) -> None:
        self.inner.release(rid)


class FollowerRunner:
    """A follower's runner: agree on the batch, run the forward pass (the all-reduces), and
    return rank 0's tokens."""

    def __init__(self, inner: Any, channel: Channel) -> None:
        self.inner = inner
        self.channel = channel
        self.eos_token_id: int = inner.eos_token_id
        self.synced = False
        self.seq = -1

    def run(self, batch: StepBatch) -> StepResult:
        self.synced = True
        self.channel.agree(batch_digest(batch), self.seq)
        self.inner.forward(batch)
        tokens, failed = self.channel.broadcast(None)
        return StepResult(tokens, failed=failed)

    def release(self, rid: str) -> None:
        self.inner.release(rid)
