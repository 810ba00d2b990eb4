"""A request inside the engine: its tokens, its page tables per KV label, and how far it got.

Progress is two numbers, not a phase: `num_tokens` (prompt plus output so far) and `num_computed`
(positions whose KV is written). A row computes positions [num_computed, num_tokens); when it
reaches num_tokens it samples. A fresh request, one resumed after preemption and a decoding one
are the same case.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbank.capacity import (
    CapacityModel,
    LabelTerms,
    PageCount,
    RequestShape,
    count_pages,
    label_terms,
    pages_for,
)
from kvbank.engine.kv.pages import SINK_PAGE
from kvbank.engine.runner import SamplingParams
from kvbank.ledger import PeakShape, peak_shape
from kvbank.service_class import ServiceClass

if TYPE_CHECKING:
    from kvbank.engine.sequences import SequenceGroup


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the model's stop token
    LENGTH = "length"  # max_tokens, or the max_seq_len cap on it
    ABORT = "abort"  # the client went away
    REJECTED = "rejected"  # the pool can never hold it
    ERROR = "error"  # its row could not be sampled (the step's RowFailure says why)


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    shape: RequestShape
    count: PageCount  # worst case, from the one capacity function
    layout: tuple[LabelTerms, ...]  # the labels it writes; the others go to the sink page
    # Its growth per label as the peak-fit ledger reads it (its prefill bound is set when it is
    # tried for admission); made with `count` at ingest, never recounted.
    peak_shape: PeakShape
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival: int = 0  # arrival order
    # What the pool promises it (kvbank/service_class.py); strict when its KV cannot be rebuilt.
    service_class: ServiceClass = ServiceClass.STRICT
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    pages: dict[str, list[int]] = field(default_factory=dict)  # label -> page table
    held: int = 0  # pages referenced, all labels, shared prefix pages included
    indexed: int = 0  # prompt pages already offered to the prefix index
    index_open: bool = True  # False once a chain diverged from the index
    pinned: dict[str, list[int]] = field(default_factory=dict)  # waiting: hit pages held for it
    hit_pages: int = 0  # cached pages leased at the last admission (all labels)
    admitted_at: int = -1  # admission order, for preemption's "most recently admitted"
    preemptions: int = 0
    page_size: int = 16
    worst: int = 0  # count.total, kept as a plain number: the step reads it per row
    # Only a request whose every label is keyed can skip positions: a hit in one label would
    # leave the others' KV for those positions unwritten.
    cacheable: bool = False
    room: int = 0  # positions the held pages cover; a decode row within it allocates nothing
    # May be preempted to make room for strict requests; the pages only such requests hold are
    # reclaimable supply for strict admission. Set at ingest from `service_class`; cleared
    # (for the rest of its life) once it was preempted the pool's `max_preemptions` times, and
    # only while it holds and pins no page (the cache counts strict holders per page).
    best_effort: bool = False
    # Preempted with every computed page indexed, its output's too: a hit may cover them.
    output_cached: bool = False
    # The sequences sampled from one prompt (n > 1), engine/sequences.py; None: a lone one.
    group: SequenceGroup | None = None

    @property
    def holder(self) -> Request:
        """The request admission knows this sequence by: its group's first, or itself."""
        return self if self.group is None else self.group.leader

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def max_output(self) -> int:
        return self.count.output_tokens

    def token(self, position: int) -> int:
        prompt_len = len(self.prompt)
        return (
            self.prompt[position] if position < prompt_len else self.output[position - prompt_len]
        )

    def tokens(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt)
        if stop <= prompt_len:
            return self.prompt[start:stop]
        if start >= prompt_len:  # decode: no copy of the prompt
            return self.output[start - prompt_len : stop - prompt_len]
        return self.prompt[start:] + self.output[: stop - prompt_len]

    def page_table(self, label: str) -> list[int]:
        """The pages a runner reads and writes for `label`. A label this request does not
        write maps to the sink page: its rows (a text request in a guidance batch, say) are
        written there and never read back, and take no page of the pool."""
        table = self.pages.get(label)
        if table is None and not any(lay.name == label for lay in self.layout):
            return [SINK_PAGE]
        return table or []

    def pages_at(self, positions: int) -> int:
        """Pages the request holds once `positions` positions are written (all labels)."""
        prompt_len = len(self.prompt)
        size = self.page_size
        return sum(pages_for(lay.tokens_at(positions, prompt_len), size) for lay in self.layout)

    @property
    def max_hit_pages(self) -> int:
        """Full prompt pages a hit may cover per label (and output pages, once its output was
        cached), leaving at least one position to compute (the last one gives the logits) and
        never a shared page to write into."""
        if self.output_cached:
            return (self.num_tokens - 1) // self.page_size
        return min(len(self.prompt), self.num_tokens - 1) // self.page_size

    def keyed_tokens(self) -> list[int]:
        """The tokens the prefix index keys this request's pages by."""
        return self.prompt + self.output if self.output_cached else self.prompt


def build_request(
    model: CapacityModel,
    rid: str,
    prompt: list[int],
    shape: RequestShape,
    count: PageCount,
    sampling: SamplingParams | None = None,
    arrival: int = 0,
    service_class: ServiceClass = ServiceClass.STRICT,
) -> Request:
    """A request from its shape and the capacity function's count of it, made once at ingest
    (engine.py) and carried: nothing on the serving path counts its pages again."""
    req = Request(
        rid=rid,
        prompt=prompt,
        shape=shape,
        count=count,
        layout=tuple(label_terms(model, shape).values()),
        peak_shape=peak_shape(model, shape, count=count),
        sampling=sampling or SamplingParams(),
        arrival=arrival,
        service_class=service_class,
        page_size=model.page_size,
    )
    req.worst = count.total
    req.best_effort = service_class is ServiceClass.BEST_EFFORT
    req.cacheable = all(label.keyed for label in req.layout)
    return req


def make_request(
    model: CapacityModel,
    rid: str,
    prompt: list[int],
    max_tokens: int | None = None,
    extra_tokens: dict[str, int] | None = None,
    labels: frozenset[str] | None = None,
    sampling: SamplingParams | None = None,
    arrival: int = 0,
) -> Request:
    """A request counted here (for callers that hold no count: tests and tools)."""
    shape = RequestShape(len(prompt), max_tokens, dict(extra_tokens or {}), labels)
    return build_request(
        model, rid, list(prompt), shape, count_pages(model, shape), sampling, arrival
    )
