"""Where a router sent each prompt's blocks: an approximate prefix index, one record per pod.

The sidecars do not stream their pods' prefix caches, so the picker keeps its own record, as
llm-d's prefix scorer does. A prompt's full blocks (a page of tokens each) are hashed in a
chain, so a block's hash stands for the whole prefix up to it; a pick records all of the
request's blocks for the pod it chose; a pod's record keeps its most recent `capacity` blocks.
A request's affinity for a pod is how many of its leading blocks the record holds. It is
approximate: the pod may have evicted a block its record still holds, and another picker
replica's picks are not in it. The rule only breaks ties with it (kvbank/picker/rule.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, KeysView, Sequence

MAX_PREFIX_BLOCKS = 256  # blocks of a prompt counted, as llm-d's prefix scorer's default


def prompt_blocks(prompt: Sequence[int], block_tokens: int, limit: int | None = None) -> list[int]:
    """The prompt's full blocks of `block_tokens` tokens, at most `limit`, each hashed with the
    one before it, so a block's hash stands for the whole prefix up to it."""
    blocks: list[int] = []
    previous = 0
    count = len(prompt) // block_tokens
    if limit is not None:
        count = min(count, limit)
    for index in range(count):
        previous = hash((previous, *prompt[index * block_tokens : (index + 1) * block_tokens]))
        blocks.append(previous)
    return blocks


class PrefixRecord:
    """The blocks recently routed to one pod, the oldest forgotten past `capacity`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix record holds at least one block, not {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, blocks: Iterable[int]) -> None:
        held = self._blocks
        for block in blocks:
            held[block] = None
            held.move_to_end(block)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def matched(self, blocks: Sequence[int]) -> int:
        """How many of `blocks`, from the first, the record holds."""
        held = self._blocks
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

    def blocks(self) -> KeysView[int]:
        """The blocks held, as a live set."""
        return self._blocks.keys()


__all__ = ["MAX_PREFIX_BLOCKS", "PrefixRecord", "prompt_blocks"]
