"""Pages a newcomer's hit leased that exactly one running request held (`Hit.sole`). That holder
returns that many fewer pages when it finishes, and the ledger is not told which request it is,
so any running request may be. But the pages are so many in all: however many holders finish,
together they return at most that many fewer, and no holder fewer than it would have returned.
By step k a sharing costs min(its pages, what the holders finished by k would return), never
less than the truth (`SharedHits.deficit`); counting the pages off every holder's return
instead can cost more than the hit saved, so that a hit hurt where no hit fitted.

A holder leaves a sharing when the pool counts its pages exactly (a progress report's or a
pin's `exclusive`: that count no longer has the shared pages) or when it finishes; a sharing
ends when its owner finishes (the pages are the holder's alone again) or no holder is left."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvbank.ledger.profile import Profile
from kvbank.ledger.shape import Steps


@dataclass
class Sharing:
    owner: str  # the request that leased them
    pages: int
    holders: set[str]  # the running requests that may be the one that held them alone


class SharedHits:
    def __init__(self) -> None:
        self.sharings: list[Sharing] = []
        self._cached: tuple[Profile, Steps] | None = None  # deficit at a profile's candidates

    def copy(self) -> SharedHits:
        twin = SharedHits()
        twin.sharings = [Sharing(s.owner, s.pages, set(s.holders)) for s in self.sharings]
        return twin

    def add(self, owner: str, pages: int, holders: Iterable[str]) -> None:
        held = set(holders) - {owner}
        if pages and held:
            self.sharings.append(Sharing(owner, pages, held))
            self._cached = None

    def counted(self, rid: str) -> None:
        """The pool counted `rid`'s exclusive pages exactly: it leaves every sharing."""
        if any(rid in s.holders for s in self.sharings):
            for s in self.sharings:
                s.holders.discard(rid)
            self._drop(lambda s: not s.holders)

    def leave(self, rid: str) -> int:
        """`rid` finished: the most its release may return less than its exclusive count
        (the pages of the sharings it may have held). It leaves them, and those it owned end."""
        short = sum(s.pages for s in self.sharings if rid in s.holders)
        for s in self.sharings:
            s.holders.discard(rid)
        self._drop(lambda s: s.owner == rid or not s.holders)
        return short

    def _drop(self, gone: Callable[[Sharing], bool]) -> None:
        self.sharings = [s for s in self.sharings if not gone(s)]
        self._cached = None

    def deficit(self, profile: Profile, ks: Steps) -> Steps:
        """Pages the running requests' finishes by steps `ks` may return fewer than their
        exclusive counts say: each sharing's pages, at most what its finished holders hold."""
        out = np.zeros(len(ks), dtype=np.int64)
        if not self.sharings:
            return out
        index = {rid: i for i, rid in enumerate(profile.columns.rids)}
        lines = profile.columns.lines
        for s in self.sharings:
            rows = np.fromiter((index[rid] for rid in s.holders), dtype=np.int64)
            order = np.argsort(lines.end[rows], kind="stable")
            ends = lines.end[rows][order]
            by = np.concatenate([[0], np.cumsum(lines.exclusive[rows][order])])
            out += np.minimum(s.pages, by[np.searchsorted(ends, ks, side="right")])
        return out

    def at_candidates(self, profile: Profile) -> Steps:
        """`deficit` at the profile's candidate steps, kept until the profile or a sharing
        changes."""
        if self._cached is None or self._cached[0] is not profile:
            self._cached = (profile, self.deficit(profile, profile.candidates))
        return self._cached[1]
