"""The room curve: what a newcomer started now may take at each step of a peak-fit ledger, in a
form that travels (a sidecar streams it to an endpoint picker), so that a request can be tested
against a pod as that pod's ledger will test it (`Timeline.fits`) without asking the pod.

The ledger admits a newcomer when, at every step k from now, the running requests' extra demand
D(k) plus the newcomer's own N(k) stays within the supply S. The profile's candidate steps are
step 0, the step before each finish and the last finish (after which nothing changes); between
two of them D only rises. The curve samples D there and at steps spaced by a tenth between them
(1, 2, 3, ... 11, 12, 13, 14, 16, ...), and pairs each sample c with S - D(c), the room over
the stretch that ends at c (D only rises along it, so D(k) <= D(c) there). The newcomer's N
only rises until its own end, and is at most 0 after it. So a newcomer fits the curve when, for
each stretch that holds a step before its end, N(min(c, end - 1)) <= S - D(c), the last pair
standing for every step after it as well (N(end - 1) there); a stretch after its end is no
test of it. That test never admits what the
ledger's would refuse and is close to it (within a tenth of the steps); the ledger decides.

A curve may be cut to fewer pairs (`at_most`): a run of pairs becomes its last step with the
least room of the run, which only lowers what fits. Holds a picker took but the engine has not
yet submitted come off every step (`less`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from weakref import WeakKeyDictionary

import numpy as np
import numpy.typing as npt

from kvbank.ledger.ledger import Ledger
from kvbank.ledger.profile import Profile
from kvbank.ledger.shape import Pace, PeakShape, Steps, newcomer
from kvbank.ledger.timeline import Timeline

SAMPLE_GROWTH = 1.1  # between candidates, D is sampled at steps about a tenth apart


@dataclass(frozen=True)
class RoomCurve:
    """`steps`: ascending; `room`: pages a newcomer may hold at each step up to the pair's own
    (from the step after the pair before; the first pair from now); `pace` and `page_size`: the
    ledger's, which a newcomer's growth is counted in."""

    steps: tuple[int, ...]
    room: tuple[int, ...]
    pace: Pace
    page_size: int
    _steps: Steps = field(init=False, repr=False, compare=False)
    _room: Steps = field(init=False, repr=False, compare=False)
    _starts: Steps = field(init=False, repr=False, compare=False)  # each stretch's first step
    _least: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.steps or len(self.steps) != len(self.room) or self.steps[0] < 0:
            raise ValueError(
                f"a room curve needs as many rooms as steps ({len(self.steps)}, at least one, "
                f"none negative), got {len(self.room)} rooms"
            )
        if any(b <= a for a, b in pairwise(self.steps)):
            raise ValueError(f"a room curve's steps must ascend, got {list(self.steps)[:8]}...")
        if self.page_size < 1 or self.pace.advance < 1 or self.pace.lookahead < 0:
            raise ValueError(
                f"a room curve needs page_size >= 1 ({self.page_size}), a pace advancing >= 1 "
                f"({self.pace.advance}) and lookahead >= 0 ({self.pace.lookahead})"
            )
        # Read once, for every request a picker tests against this curve.
        steps = np.array(self.steps, dtype=np.int64)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_room", np.array(self.room, dtype=np.int64))
        object.__setattr__(self, "_starts", np.concatenate([[0], steps[:-1] + 1]))
        object.__setattr__(self, "_least", min(self.room))

    def less(self, pages: int) -> RoomCurve:
        """The curve with `pages` taken off every step."""
        if not pages:
            return self
        room = tuple(r - pages for r in self.room)
        return RoomCurve(self.steps, room, self.pace, self.page_size)

    def at_most(self, pairs: int) -> RoomCurve:
        """At most `pairs` pairs: each run of pairs becomes its last step with its least room."""
        if len(self.steps) <= pairs:
            return self
        bounds = np.linspace(0, len(self.steps), pairs + 1).astype(np.int64)
        room = np.array(self.room, dtype=np.int64)
        runs = list(pairwise(int(b) for b in bounds))
        steps = tuple(self.steps[b - 1] for _, b in runs)
        least = tuple(int(room[a:b].min()) for a, b in runs)
        return RoomCurve(steps, least, self.pace, self.page_size)

    def fits(self, shape: PeakShape, held_hit_pages: int = 0) -> bool:
        """Whether a newcomer of `shape`, started now, stays within the room at every step;
        `held_hit_pages`: pages of its cached prefix that running requests hold (it leases
        them, so they take no new page)."""
        if shape.pages - held_hit_pages <= self._least:  # its worst case fits every step
            return True
        end = shape.prefill_chunks + shape.output_budget
        last = max(end - 1, 0)
        ks = np.minimum(self._steps, last)
        ks[-1] = last  # the last pair stands for every step after it
        need = newcomer(shape, self.pace, self.page_size, ks, 0, held_hit_pages, 0, True)
        # A stretch that starts at or after the newcomer's end does not see it: what room is
        # left there (holds counted at their worst at every step may leave less than none) is
        # no test of it.
        alive = self._starts < end
        return bool((need[alive] <= self._room[alive]).all())


def room_curve(ledger: Ledger) -> RoomCurve | None:
    """The ledger's room curve, or None for a ledger that follows no progress (its headroom is
    then its whole test). Built once per demand profile and supply: a profile is immutable and
    replaced whenever the running requests change, so the pair says when the curve is stale (a
    sidecar reads it on every hold, the cluster bench on every pick)."""
    timeline = ledger.timeline
    if not isinstance(timeline, Timeline) or not timeline.peak_active:
        return None
    profile = timeline.profile()
    supply = ledger.books.supply
    known = _BUILT.get(profile)
    if known is not None and known[0] == supply:
        return known[1]
    candidates = profile.candidates
    steps = np.union1d(candidates, _samples(int(candidates[-1])))
    room = supply - profile.demand(steps)
    curve = RoomCurve(
        tuple(int(s) for s in steps),
        tuple(int(r) for r in room),
        timeline.pace,
        timeline.peak_policy.page_size,
    )
    _BUILT[profile] = (supply, curve)
    return curve


# The curve last built from each live profile, with the supply it was built for.
_BUILT: WeakKeyDictionary[Profile, tuple[int, RoomCurve]] = WeakKeyDictionary()


def _samples(last: int) -> npt.NDArray[np.int64]:
    """Steps 1 to `last`, each about a tenth past the one before (at least one step)."""
    out: list[int] = []
    step = 1
    while step <= last:
        out.append(step)
        step = max(step + 1, int(step * SAMPLE_GROWTH))
    return np.array(out, dtype=np.int64)


__all__ = ["RoomCurve", "room_curve"]
