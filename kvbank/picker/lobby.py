"""Strict requests the picker holds until a pod's ledger admits them (late binding).

Once a request is sent to a pod, it waits in that pod's queue even when another pod frees room
first. So a strict request that no pod admits now is not sent anywhere yet: it waits here, in
arrival order, and is asked again whenever a pod's figures change. It goes to the first pod
that admits it, which is where it starts soonest, known rather than estimated. The pods then
act as one queue rather than one queue each, and the head of that queue waits for the first of
all the pods' releases instead of for one pod's.

Each held request that no pod admits claims the pod where it would start soonest (the rule's
waiting pick). A request behind it may still go to a pod that admits it now, but not to a pod
claimed by a request ahead of it: it cannot take the room that request waits for. This is the
ledger's backfill promise, across pods.

A request held `max_hold_s` is sent where it starts soonest, as with no lobby, and waits in
that pod's queue; the gateway's ext_proc message timeout must be longer than that.

Pure: no I/O, no clock. The picker (kvbank/picker/extproc.py) and the cluster bench
(engine/bench/cluster.py) drive it with their own clocks and figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.picker.rule import Answer, NoEndpoint, Pick, PodFigures, RequestCount, pick

DEFAULT_MAX_HOLD_S = 10.0


@dataclass
class Held:
    request: RequestCount
    since: float
    claimed: str | None = None  # the pod this request waits for, which none behind it may take


class Lobby:
    def __init__(self, max_hold_s: float = DEFAULT_MAX_HOLD_S) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must not be negative (0: hold nothing), not {max_hold_s}")
        self.max_hold_s = max_hold_s
        self._held: dict[str, Held] = {}  # in arrival order

    def __len__(self) -> int:
        return len(self._held)

    def in_order(self) -> list[str]:
        """The held requests, the longest held first."""
        return list(self._held)

    def since(self, key: str) -> float:
        return self._held[key].since

    def request(self, key: str) -> RequestCount:
        return self._held[key].request

    def enter(self, key: str, request: RequestCount, now: float) -> None:
        if key in self._held:
            raise ValueError(f"request {key!r} is already held")
        self._held[key] = Held(request, now)

    def leave(self, key: str) -> None:
        self._held.pop(key, None)

    def ask(self, key: str, pods: Sequence[PodFigures], now: float) -> Answer | None:
        """Where the held request `key` goes now, or None: it waits (ask again when a pod's
        figures change). A pick it gets claims that pod until it leaves, so a hold the pod then
        refuses keeps the request's place."""
        held = self._held[key]
        everywhere = pick(held.request, pods)
        if not isinstance(everywhere, Pick):
            return everywhere  # a refusal (400, 429) or no ready pod (503) does not wait
        if now - held.since >= self.max_hold_s:
            held.claimed = everywhere.pod
            return everywhere
        claimed: set[str] = set()
        for other_key, other in self._held.items():
            if other_key == key:
                break
            if other.claimed is not None:
                claimed.add(other.claimed)
        free = [pod for pod in pods if pod.name not in claimed]
        answer: Answer = everywhere
        if len(free) < len(pods):  # with nothing claimed, the pick is the one just made
            answer = pick(held.request, free) if free else NoEndpoint("every pod is claimed")
        if isinstance(answer, Pick) and not answer.waits:
            held.claimed = answer.pod
            return answer
        # No unclaimed pod admits it now: it claims where it starts soonest among them.
        held.claimed = answer.pod if isinstance(answer, Pick) else None
        return None

    def claim(self, key: str) -> str | None:
        """The pod the held request `key` waits for, as its last answer left it."""
        return self._held[key].claimed


__all__ = ["DEFAULT_MAX_HOLD_S", "Lobby"]
