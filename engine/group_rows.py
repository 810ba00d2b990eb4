"""What the scheduler does with a group of sequences sampled from one prompt (the group and
what admission reads of it: engine/sequences.py): start it, give it rows, preempt it whole,
finish its sequences one by one. `GroupRows` is part of the scheduler (a base class of
`Scheduler`), kept apart so the scheduler's module stays readable; what it reads of the
scheduler is `_Scheduling`."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from kvbank.engine.request import FinishReason, Request, Status
from kvbank.engine.sequences import SequenceGroup, held
from kvbank.ledger import InvariantBreach

if TYPE_CHECKING:
    from kvbank.engine.admission.policy import AdmissionPolicy
    from kvbank.engine.kv.cache import KVCache
    from kvbank.engine.scheduler import Finished, Row, SchedulerStats


class _Scheduling(Protocol):
    """The scheduler, as its group rows read and change it."""

    kv: KVCache
    policy: AdmissionPolicy
    rows: dict[str, Row]
    running: dict[str, Request]
    finished: list[Finished]
    stats: SchedulerStats
    budget_left: int

    def _decode_row(self, req: Request) -> None: ...
    def _prefill_row(self, req: Request) -> None: ...
    def _leave(self, req: Request) -> None: ...
    def _protected(self) -> Collection[int]: ...
    def _group_prefill_rows(self, leader: Request) -> None: ...
    def _end_sequence(self, group: SequenceGroup, seq: Request, reason: FinishReason) -> int: ...


def start_positions(req: Request) -> int:
    """Positions the leader allocates when its group starts: its own, or only the shared prompt
    when its own sequence already finished (a preempted group resumed)."""
    group = req.group
    if group is not None and req.rid in group.done:
        return group.prefix_positions
    return req.num_tokens


def sched_row(req: Request, count: int) -> Row:
    from kvbank.engine.scheduler import Row  # the scheduler imports this module

    return Row(req, req.num_computed, count, False)


def sampled(seq: Request) -> None:
    if seq.group is not None:
        seq.group.primed.add(seq.rid)


def sched_finished(seq: Request, reason: FinishReason) -> Finished:
    from kvbank.engine.scheduler import Finished  # the scheduler imports this module

    return Finished(seq, reason)


def check(leader: Request) -> None:
    """The group holds no more than its worst case, and a sequence's count matches its own
    tables."""
    group = leader.group
    assert group is not None
    total = held(leader)
    if total > leader.worst:
        raise InvariantBreach(
            f"request {leader.rid!r}: its {len(group.sequences)} sequences hold {total} pages "
            f"but may need at most {leader.worst}"
        )
    for seq in group.siblings:
        if seq.status is Status.RUNNING:
            own = sum(len(table) - group.shared for table in seq.pages.values())
            if own != seq.held:
                raise InvariantBreach(
                    f"sequence {seq.rid!r} counts {seq.held} pages of its own but its tables "
                    f"hold {own} past the {group.shared} shared"
                )


class GroupRows:
    """The scheduler's part for groups of sequences (`n` > 1)."""

    def _start_group(self: _Scheduling, leader: Request) -> None:
        """The leader was admitted and took its pages: every live sequence takes its own, under
        the leader's reservation, and the first rows go out."""
        group = leader.group
        assert group is not None
        kv = self.kv
        group.primed.clear()
        for seq in group.siblings:
            if seq.rid in group.done:
                continue
            kv.share(seq, leader, group.shared)
            grown = kv.grow(seq, seq.num_tokens, self._protected)
            if grown:
                self.policy.on_take(leader, grown)
            seq.status = Status.RUNNING
        self._group_prefill_rows(leader)

    def _group_decode_rows(self: _Scheduling, leader: Request) -> bool:
        """Decode rows for every live sequence once the group has primed; False while it
        prefills."""
        group = leader.group
        assert group is not None
        if not group.decoding():
            return False
        for seq in group.live():
            if leader.rid not in self.running:
                break  # the group was preempted by a shortage of one of its rows
            self._decode_row(seq)
        return True

    def _group_prefill_rows(self: _Scheduling, leader: Request) -> None:
        """Prefill chunks for the group's sequences that have not sampled yet, the leader first; the
        others once the shared pages are computed."""
        group = leader.group
        assert group is not None
        if leader.rid in group.done:  # its own sequence ended: it only computes the shared prompt
            count = min(group.prefix_positions - leader.num_computed, self.budget_left)
            if count > 0:
                self.rows[leader.rid] = sched_row(leader, count)
                self.budget_left -= count
        ready = group.prefix_ready()
        for seq in group.live():
            if self.budget_left <= 0:
                return
            if seq.rid not in group.primed and (seq is leader or ready):
                self._prefill_row(seq)

    def _group_scheduled(self: _Scheduling, leader: Request) -> bool:
        group = leader.group
        assert group is not None
        return any(seq.rid in self.rows for seq in group.sequences)

    def _preempt_group(self: _Scheduling, leader: Request) -> None:
        """Take every other sequence's rows and pages back before the leader is preempted; they
        resume with the group (each recomputes its own positions, output included)."""
        group = leader.group
        assert group is not None
        for seq in group.siblings:
            row = self.rows.pop(seq.rid, None)
            if row is not None:
                self.budget_left += row.count
            if seq.rid in group.done or seq.status is not Status.RUNNING:
                continue
            self.kv.drop_tail(seq, group.shared)
            seq.pages = {}
            seq.num_computed = 0
            seq.status = Status.WAITING
            seq.preemptions += 1
        group.primed.clear()

    def _finish_in_group(self: _Scheduling, seq: Request, reason: FinishReason) -> None:
        """One sequence ends: its own pages go back; the group ends with its last sequence. A
        leader that ends before it computed the shared prompt ends the whole group (the others
        would have nothing to read)."""
        group = seq.group
        assert group is not None
        leader = group.leader
        if seq.rid in group.done:
            return
        if seq is leader and not group.prefix_ready():
            for other in group.live():
                self._end_sequence(group, other, reason)
            freed = 0
        else:
            freed = self._end_sequence(group, seq, reason)
        if not group.live():
            if leader.status is Status.RUNNING:
                self._leave(leader)
            leader.status = Status.FINISHED
        elif leader.status is Status.RUNNING:
            # The others run on: this sequence's share of the reservation goes back now.
            own = (leader.worst - group.shared * len(leader.layout)) // len(group.sequences)
            self.policy.on_give_back(leader, freed, own)

    def _end_sequence(
        self: _Scheduling, group: SequenceGroup, seq: Request, reason: FinishReason
    ) -> int:
        """End one sequence; returns the pages of its own it freed."""
        group.done.add(seq.rid)
        freed = 0
        if seq.status is Status.RUNNING:
            freed = self.kv.drop_tail(seq, group.shared)
            if seq is not group.leader:
                seq.pages = {}
        if seq is not group.leader:
            seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.finished.append(sched_finished(seq, reason))
        self.stats.finished += 1
        return freed
