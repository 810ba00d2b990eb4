"""What a policy reads of the scheduler's state (`AdmissionView`): the queues, read-only, whether
another request may start this step, which running requests got a row, and the KV cache's
read-only face (engine/kv/view.py). The scheduler builds one and hands it to its policy; the
policy holds no reference to the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvbank.capacity import CapacityModel
from kvbank.engine.kv.view import CacheView
from kvbank.engine.request import Request


@dataclass(frozen=True)
class AdmissionView:
    model: CapacityModel
    kv: CacheView
    waiting: Sequence[Request]  # FIFO: waiting[0] is the head
    waiting_by_rid: Mapping[str, Request]
    running: MappingProxyType[str, Request]  # in admission order
    max_batch_tokens: int
    max_running: int
    can_start: Callable[[], bool]  # token budget and running cap left this step
    scheduled: Callable[[str], bool]  # whether a running request got a row this step
