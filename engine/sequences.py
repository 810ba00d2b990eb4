"""Sequences sampled from one prompt (OpenAI's `n`): one request to admission, n rows to run.

The group's first sequence, the leader, is the request admission knows. It waits in the queue,
is counted once by count_pages with `sequences = n` (its `count` and `peak_shape` are the
group's), leases the prompt's cached prefix and holds the prompt's pages; every page a sequence
of the group takes is reported as the leader's. The other sequences never reach admission.

When the group starts, each other sequence reads the leader's first `shared` pages per label
(`KVCache.share`: read, not held, so the group is one holder of them and refcounts, sole-held
hits and exclusive counts read as they do for a lone request) and allocates the pages it writes
itself: its copy of the page holding the prompt's last token, whose logits give its first token.
It computes from the shared pages on once the leader has computed them.

The group prefills (the leader's prompt, then each sequence's own prompt positions) and only
then decodes, every live sequence one row per step. So to the ledger it is one request whose
prefill ends when its last sequence has sampled its first token and whose n rows grow at once
(the group's peak shape, kvbank.capacity.label_growth). Sequences finish on their own: a
finished one's own pages go back to the pool at once (the shared ones stay with the group),
and the group leaves the running set, and admission hears `on_release`, when the last one
ends. A group is preempted whole or not at all. docs/admission.md has the argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbank.capacity import CapacityModel, group_tokens, pages_for
from kvbank.engine.request import Request, Status
from kvbank.ledger import PeakShape, peak_shape

if TYPE_CHECKING:
    from kvbank.engine.kv.view import CacheView


@dataclass(eq=False)
class SequenceGroup:
    leader: Request
    siblings: list[Request]
    shared: int  # prompt pages per label the leader holds for all (shared_prompt_pages)
    page_size: int
    primed: set[str] = field(default_factory=set)  # sampled their first token since the start
    done: set[str] = field(default_factory=set)  # finished sequences

    @property
    def sequences(self) -> list[Request]:
        return [self.leader, *self.siblings]

    def live(self) -> list[Request]:
        return [seq for seq in self.sequences if seq.rid not in self.done]

    def decoding(self) -> bool:
        """Every live sequence has sampled its first token since the group started."""
        return all(seq.rid in self.primed for seq in self.live())

    @property
    def prefix_positions(self) -> int:
        return self.shared * self.page_size

    def prefix_ready(self) -> bool:
        """The leader has computed the shared pages (the other sequences read them)."""
        leader = self.leader
        return leader.status is Status.RUNNING and leader.num_computed >= self.prefix_positions


def group_of(
    leader: Request, siblings: list[Request], shared: int, page_size: int
) -> SequenceGroup:
    group = SequenceGroup(leader, siblings, shared, page_size)
    for seq in group.sequences:
        seq.group = group
    return group


# ---- what admission reads (a lone request reads as itself) ------------------------------------


def held(req: Request) -> int:
    """Pages the request holds, all its sequences together."""
    if req.group is None:
        return req.held
    return sum(seq.held for seq in req.group.sequences)


def pages_at(req: Request, positions: Callable[[Request], int]) -> int:
    """Pages the request holds once each of its live sequences has `positions(seq)` positions
    written: its shared prompt pages once, and each sequence's own."""
    group = req.group
    if group is None:
        return req.pages_at(positions(req))
    common = group.shared * len(req.layout)
    return common + sum(seq.pages_at(positions(seq)) - common for seq in group.live())


def start_pages(req: Request) -> int:
    """Pages a waiting request takes when it starts (its whole prompt, every sequence's)."""
    return pages_at(req, lambda seq: seq.num_tokens)


def prefill_tokens(req: Request) -> int:
    """Positions the request still has to compute before it decodes, all sequences."""
    group = req.group
    if group is None:
        return req.num_tokens - req.num_computed
    leader, prefix = group.leader, group.prefix_positions
    left = max(0, prefix - leader.num_computed) if leader.rid in group.done else 0
    for seq in group.live():
        if seq.rid not in group.primed:
            computed = seq.num_computed if seq is leader else max(seq.num_computed, prefix)
            left += seq.num_tokens - computed
    return left


def prefilled(req: Request) -> bool:
    """Whether the request's prefill is done: what is left to compute is its next decode row.
    A preempted request resumes with its output to compute again (as prompt, its prefill
    bound counts it), so its prompt alone computed is not the end of its prefill."""
    if req.group is None:
        return req.num_computed >= req.num_tokens - (1 if req.output else 0)
    return req.group.decoding()


def progress(req: Request, kv: CacheView) -> tuple[int, dict[str, int], int]:
    """A running group's progress as its peak shape reads it: output tokens (its slowest live
    sequence's), tokens per label (kvbank.capacity.group_tokens: each live sequence's own
    written tokens, never below its own prompt tokens; the finished ones gave theirs back), and
    its pages no other request holds."""
    group = req.group
    assert group is not None
    live, prompt_len = group.live(), len(req.prompt)
    produced = min(len(seq.output) for seq in live)
    written = {}
    worst_tokens = [
        (group.shared + len(live) * (pages_for(tokens, group.page_size) - group.shared))
        * group.page_size
        for tokens in req.count.tokens_per_label.values()
    ]
    for lay, worst in zip(req.layout, worst_tokens, strict=True):
        floor = lay.tokens_at(prompt_len, prompt_len)
        own = [
            max(lay.tokens_at(seq.num_computed, prompt_len), floor) - group.prefix_positions
            for seq in live
        ]
        written[lay.name] = group_tokens(group.page_size, group.shared, worst, own)
    return produced, written, kv.exclusive_pages(req)


def live_shape(model: CapacityModel, req: Request) -> PeakShape:
    """The growth of what still runs of a group whose sequence finished: its live sequences'."""
    group = req.group
    assert group is not None
    chunks = req.peak_shape.prefill_chunks
    return peak_shape(model, req.shape, chunks, req.count, live=len(group.live()))
