"""The picker's routing rule: which pod a request goes to, from each pod's ledger figures.

Pure: no I/O, no clock. The caller (the endpoint picker, or the cluster bench) gathers each
pod's `PodFigures` and the request's `RequestCount` and asks `pick`, which answers one of

- `Pick(pod)`: send it there;
- `Refuse(message, 400)`: no pod could ever hold it (the capacity function's message);
- `Shed(429)`: a best-effort request, and every pod is full;
- `NoEndpoint(503)`: no ready pod.

The rule (issue 23): a strict request goes to a pod whose ledger would admit it now; with none,
to the pod where it would start soonest. A best-effort request goes to the pod with the most
room; with room nowhere, it queues where the best-effort backlog is least, and only when every
pod's backlog is a pool deep are the pods full (429). Ties are broken by prefix affinity, then
queue depth, then the most headroom, then the pod's name (so the same figures always give the
same pick).

"Admit now" is the ledger's own test for a head (kvbank/ledger/ledger.py, `Ledger.try_admit`),
and a pod admits a newcomer now only with nothing waiting ahead of it (FIFO: only the head is
admitted). Its first part is `pages <= headroom_pages`, the ledger's `headroom` (`supply -
outstanding`; with peak-fit, supply less the timeline's highest demand). A peak-fit ledger
admits more: a request whose pages at each step fit beside what the running requests may hold
then, though its worst case is over the headroom; with the pod's room curve
(kvbank/ledger/room.py) the rule tests the request's shape as the ledger does. The part of the
request's cached prefix that running requests hold there comes off its need (`PodFigures.need`),
as it does in the ledger's test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvbank.capacity import (
    SINK_PAGES,
    CapacityModel,
    RequestShape,
    count_pages,
    refusal,
    refusal_message,
)
from kvbank.ledger import PeakShape, peak_shape
from kvbank.ledger.room import RoomCurve
from kvbank.service_class import ServiceClass


@dataclass(frozen=True)
class Release:
    """Pages a pod's headroom gains `eta_s` seconds from now (a running request finishing
    returns its whole reservation: what it held and what it may still take)."""

    eta_s: float
    pages: int


@dataclass(frozen=True)
class PodFigures:
    """One pod's figures, as its ledger has them now.

    `headroom_pages`: the largest worst case the ledger's conservative test admits now as head,
    `supply - outstanding` (negative is clamped to none). `waiting_pages`: the worst cases of the
    requests waiting there, FIFO. `releases`: when headroom comes back, soonest first as far as
    the pod can tell; `best_effort_room_pages`: pages a best-effort request could start on now
    (what strict promises and running best-effort requests leave, less what the queues wait
    for); `best_effort_backlog_pages`: what the best-effort requests queued there (and routed
    there, not yet arrived) need to start. `cached_blocks`: the prefix block hashes the pod's
    index holds, for affinity."""

    name: str
    usable_pages: int
    headroom_pages: int
    waiting_pages: tuple[int, ...] = ()
    releases: tuple[Release, ...] = ()
    best_effort_room_pages: int = 0
    best_effort_backlog_pages: int = 0
    cached_blocks: AbstractSet[int] = field(default_factory=frozenset)
    ready: bool = True
    # Of `cached_blocks`, those a running request holds (one block is one page): a hit on them
    # costs the pod no new page, so the ledger admits a request that much larger. A hit on a
    # block only the index holds saves nothing (those pages already count as supply).
    held_blocks: frozenset[int] = field(default_factory=frozenset)
    # A peak-fit ledger's room at each step from now (less the holds pickers took), for the
    # ledger's own test of a request's shape; None: the headroom is the whole test.
    room: RoomCurve | None = None

    def __post_init__(self) -> None:
        if self.usable_pages < 0 or self.headroom_pages > self.usable_pages:
            raise ValueError(
                f"pod {self.name!r}: headroom_pages {self.headroom_pages} must be at most "
                f"usable_pages {self.usable_pages}, which must not be negative"
            )
        if any(pages < 0 for pages in self.waiting_pages):
            raise ValueError(f"pod {self.name!r}: waiting_pages must not be negative")
        if self.best_effort_backlog_pages < 0:
            raise ValueError(f"pod {self.name!r}: best_effort_backlog_pages must not be negative")

    @property
    def queue_depth(self) -> int:
        return len(self.waiting_pages)

    def admits_now(self, pages: int, shape: PeakShape | None = None, held_hit: int = 0) -> bool:
        """Whether the ledger admits a newcomer of `pages` worst-case pages at once (`pages`
        less its `held_hit`); with its `shape`, tested on the room curve too."""
        if self.waiting_pages:
            return False
        if pages - held_hit <= self.headroom_pages:
            return True
        return shape is not None and self.room is not None and self.room.fits(shape, held_hit)

    def admits(self, request: RequestCount) -> bool:
        """`admits_now` for `request`, its held prefix counted."""
        held = request.pages - self.need(request.pages, request.prefix_blocks)
        return self.admits_now(request.pages, request.shape, held)

    def need(self, pages: int, blocks: Sequence[int]) -> int:
        """What a request of `pages` worst-case pages takes of this pod's headroom: the ledger
        admits `reserved - hit <= supply - idle - outstanding`, so the part of its cached prefix
        that running requests hold comes off (the idle part nets to nothing)."""
        shared = 0
        for block in blocks[: self.affinity(blocks)]:
            if block in self.held_blocks:
                shared += 1
        return max(0, pages - shared)

    def start_estimate(self, pages: int) -> tuple[float, int]:
        """(seconds until a newcomer of `pages` would start here, pages short now): it starts
        once the releases cover what the queue ahead and it need beyond today's headroom.
        `math.inf` when the releases the pod reports never cover it."""
        short = sum(self.waiting_pages) + pages - max(0, self.headroom_pages)
        if short <= 0:
            return 0.0, 0
        released = 0
        for release in sorted(self.releases, key=lambda r: r.eta_s):
            released += release.pages
            if released >= short:
                return release.eta_s, short
        return math.inf, short

    def affinity(self, blocks: Sequence[int]) -> int:
        """How many of the request's leading prefix blocks the pod holds (a prefix match stops
        at the first block it lacks, as the index's does)."""
        matched = 0
        for block in blocks:
            if block not in self.cached_blocks:
                break
            matched += 1
        return matched


@dataclass(frozen=True)
class RequestCount:
    """A request as the picker counts it: `pages`, its worst case from `kvbank.capacity`
    (`count_request`); `start_pages`, what a best-effort admission takes at start (prompt plus
    output estimate; the worst case for strict); `refusal`, the capacity function's message when
    the pool can never hold it; `prefix_blocks`, its prompt's block hashes, in order; `shape`,
    its growth as a peak-fit ledger counts it (`peak_shape`, one prefill chunk; None for
    several prompts in one request)."""

    pages: int
    service_class: ServiceClass = ServiceClass.STRICT
    start_pages: int | None = None
    prefix_blocks: tuple[int, ...] = ()
    refusal: str | None = None
    shape: PeakShape | None = None

    @property
    def pages_to_start(self) -> int:
        return self.pages if self.start_pages is None else self.start_pages


def count_request(
    model: CapacityModel,
    shape: RequestShape,
    pool_pages_total: int,
    service_class: ServiceClass = ServiceClass.STRICT,
    start_pages: int | None = None,
    prefix_blocks: Iterable[int] = (),
) -> RequestCount:
    """The request counted as the pod's ledger will count it: the one capacity function, and
    its refusal against a pool of `pool_pages_total` pages."""
    count = count_pages(model, shape)
    refused = refusal(model, shape, pool_pages_total, count)
    return RequestCount(
        pages=count.total,
        service_class=service_class,
        start_pages=start_pages,
        prefix_blocks=tuple(prefix_blocks),
        refusal=None if refused is None else refused.message,
        shape=None if refused is not None else peak_shape(model, shape, count=count),
    )


@dataclass(frozen=True)
class Pick:
    pod: str
    waits: bool = False  # chosen as where it starts soonest, not where it is admitted now


@dataclass(frozen=True)
class Refuse:
    message: str
    status: int = 400


@dataclass(frozen=True)
class Shed:
    message: str
    status: int = 429
    retry_after_s: int = 1  # the Retry-After the client is told: a pod frees room by then


@dataclass(frozen=True)
class NoEndpoint:
    message: str
    status: int = 503


Answer = Pick | Refuse | Shed | NoEndpoint


def pick(request: RequestCount, pods: Sequence[PodFigures]) -> Answer:
    """Where `request` goes among `pods` (the module docstring has the rule)."""
    ready = [pod for pod in pods if pod.ready]
    if not ready:
        return NoEndpoint(f"no ready endpoint among {len(pods)} pods")
    largest = max(pod.usable_pages for pod in pods)
    if request.pages > largest:
        return Refuse(request.refusal or _refusal_message(request.pages, largest))
    holding = [pod for pod in ready if pod.usable_pages >= request.pages]
    if not holding:
        return NoEndpoint(
            f"no ready endpoint can hold {request.pages} pages; the pods that can are not ready"
        )
    blocks = request.prefix_blocks

    def tie(pod: PodFigures) -> tuple[int, int, int, str]:
        # Affinity, then queue depth, then the most headroom (spreading keeps room for the
        # next large request), then the name, so equal figures always give the same pick.
        return (-pod.affinity(blocks), pod.queue_depth, -pod.headroom_pages, pod.name)

    if request.service_class is ServiceClass.BEST_EFFORT:
        need = request.pages_to_start
        roomy = [pod for pod in holding if pod.best_effort_room_pages >= need]
        if roomy:
            return Pick(min(roomy, key=lambda pod: (-pod.best_effort_room_pages, *tie(pod))).name)

        # No room now: it queues where the backlog is least, while that backlog and it fit the
        # pool (they start as the requests running there finish); with every pod's backlog a
        # pool deep, the pods are full.
        def backlog(pod: PodFigures) -> int:  # what starts there first: strict ones, then these
            return sum(pod.waiting_pages) + pod.best_effort_backlog_pages

        queues = [p for p in holding if best_effort_queues(backlog(p), need, p.usable_pages)]
        if not queues:
            return Shed(
                f"every pod is full: a best-effort request needs {need} pages to start, no "
                f"ready pod has that room now, and each has a backlog of at least "
                f"{min(backlog(p) for p in holding)} pages waiting to start"
            )
        return Pick(min(queues, key=lambda pod: (backlog(pod), *tie(pod))).name, waits=True)
    now = [pod for pod in holding if pod.admits(request)]
    if now:
        return Pick(min(now, key=tie).name)

    def soonest(pod: PodFigures) -> tuple[float, int, int, int, int, str]:
        eta, short = pod.start_estimate(pod.need(request.pages, blocks))
        return (eta, short, *tie(pod))

    return Pick(min(holding, key=soonest).name, waits=True)


def best_effort_room(headroom: int, waiting: int, held: int, backlog: int) -> int:
    """What a best-effort request could start on now at a pod: the ledger's `headroom` less the
    strict queue (`waiting`), the pages only best-effort requests hold (`held`: the ledger's
    supply counts them, since strict admission takes them back; a best-effort request cannot)
    and what the best-effort `backlog` waits to start. The sidecar streams it; the cluster
    bench computes it from its replicas the same way."""
    return headroom - waiting - held - backlog


def best_effort_queues(backlog: int, pages: int, usable: int) -> bool:
    """Whether a best-effort request of `pages` to start, with no room now, may queue behind
    `backlog` (the strict queue and the best-effort backlog): they and it fit the pod's
    `usable` pages, so they start as the requests running there finish. The rule picks by it
    and the sidecar grants a queued best-effort hold by it."""
    return backlog + pages <= usable


def _refusal_message(pages: int, usable: int) -> str:
    advice = f"lower max_tokens or raise the pool to at least {pages + SINK_PAGES} pages"
    return refusal_message(pages, usable, advice)


__all__ = [
    "Answer",
    "NoEndpoint",
    "Pick",
    "PodFigures",
    "Refuse",
    "Release",
    "RequestCount",
    "Shed",
    "best_effort_queues",
    "best_effort_room",
    "count_request",
    "pick",
]
