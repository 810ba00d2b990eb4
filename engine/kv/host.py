"""The host tier: copies of evicted prefix pages in host memory, reloaded instead of recomputed.

Pure Python over integer ids, like the device pool: a host slot is an index into the runner's
host tensors, and what moves is recorded as `HostMove`s the step's batch carries, in the order
they happened, for the runner to copy before its forward pass (a page is copied out before the
step that reuses it writes into it; a reload lands before the step reads it).

An entry is keyed by its prefix chain's digest (`chain_digest`: the digest of the page before
and this page's label and tokens), so a page evicted from the device is found again by the
same walk from the root that the prefix index does, continued here where the device chain
ends. The digest is a 128-bit BLAKE2b, so two different chains sharing one is not a practical
concern (a crafted collision would be: that is why it is not Python's `hash`); an entry also
keeps its parent digest and its tokens, and a lookup checks both.

The tier is inclusive: a reloaded page stays on host too, so evicting it again copies nothing.
Eviction on host is least recently used first; entries a reload is about to read are pinned.
An entry whose parent left both tiers can no longer be reached; it ages out like any other.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvbank.ledger import InvariantBreach

Digest = bytes
Key = tuple[int, ...]


def chain_digest(parent: Digest | None, label: str, key: Key) -> Digest:
    """The identity of a prefix chain ending in the page `key` of `label`."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(label.encode())
    h.update(b"\0")
    h.update(array("q", key).tobytes())
    return h.digest()


class Direction(enum.Enum):
    TO_HOST = "to-host"
    TO_DEVICE = "to-device"


class HostMove(NamedTuple):
    """One page copied between the device pool and the host tier."""

    direction: Direction
    page: int  # device page id
    slot: int  # host slot id


@dataclass(eq=False)
class HostEntry:
    slot: int
    digest: Digest
    parent: Digest | None
    label: str
    key: Key


class HostTier:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a host tier needs at least 1 page, got {capacity}")
        self.capacity = capacity
        # Reversed so that slot 0 is taken first: tests can name exact slot ids.
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: OrderedDict[Digest, HostEntry] = OrderedDict()  # least recent first
        self._pinned: dict[int, int] = {}  # slot -> pins
        self.moves: list[HostMove] = []  # since the last `take_moves`, in order
        self.saved = 0  # pages copied to host, ever
        self.loaded = 0  # pages copied back to the device, ever

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: Digest) -> bool:
        return digest in self._entries

    def slots(self) -> list[int]:
        """Slots that hold a page, least recently used first (for tests and reports)."""
        return [entry.slot for entry in self._entries.values()]

    def save(self, digest: Digest, parent: Digest | None, label: str, key: Key, page: int) -> bool:
        """Copy the device page of this chain to host before it is evicted. A chain already on
        host is only marked used; with no free slot the least recently used unpinned entry
        makes room. Returns False (nothing copied) when every slot is pinned."""
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self._entries[digest] = HostEntry(slot, digest, parent, label, key)
        self.moves.append(HostMove(Direction.TO_HOST, page, slot))
        self.saved += 1
        return True

    def lookup(self, parent: Digest | None, label: str, key: Key) -> HostEntry | None:
        """The host copy of the page `key` that follows the chain `parent`; a peek, not a use."""
        entry = self._entries.get(chain_digest(parent, label, key))
        if entry is None or entry.parent != parent or entry.label != label or entry.key != key:
            return None
        return entry

    def pin(self, entries: Iterable[HostEntry]) -> None:
        """Keep these entries while a reload that will read them is being prepared."""
        for entry in entries:
            self._pinned[entry.slot] = self._pinned.get(entry.slot, 0) + 1

    def unpin(self, entries: Iterable[HostEntry]) -> None:
        for entry in entries:
            count = self._pinned[entry.slot] - 1
            if count:
                self._pinned[entry.slot] = count
            else:
                del self._pinned[entry.slot]

    def load(self, entry: HostEntry, page: int) -> None:
        """Copy a host entry into a newly allocated device page: a use, so it is re-stamped."""
        if self._entries.get(entry.digest) is not entry:
            raise InvariantBreach(f"host slot {entry.slot} is reloaded after it was dropped")
        self._entries.move_to_end(entry.digest)
        self.moves.append(HostMove(Direction.TO_DEVICE, page, entry.slot))
        self.loaded += 1

    def take_moves(self) -> list[HostMove]:
        moves, self.moves = self.moves, []
        return moves

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for digest, entry in self._entries.items():
            if entry.slot not in self._pinned:
                del self._entries[digest]
                return entry.slot
        return None

    def check_integrity(self) -> None:
        """free + held == capacity, every slot exactly once."""
        held = [entry.slot for entry in self._entries.values()]
        if len(self._free) + len(held) != self.capacity:
            raise InvariantBreach(
                f"host tier: free {len(self._free)} + held {len(held)} != {self.capacity} slots"
            )
        if len(set(held) | set(self._free)) != self.capacity:
            raise InvariantBreach("host tier: a slot is both free and held, or held twice")
