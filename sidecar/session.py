"""The sidecar's record of its one engine session, and the errors a session call can end in (the
service maps each to a gRPC status that tells the engine what to do next)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank.proto import admission_pb2 as pb


class SessionGone(Exception):
    """The report names a session this sidecar does not hold (it restarted, the lease expired,
    or a newer session replaced it): the engine must open a new one."""


class OutOfOrder(Exception):
    """A sequence number that does not follow the last one."""


class PoolMismatch(Exception):
    """The engine's pool is not the pool this sidecar was started for."""


class PolicyMismatch(Exception):
    """The engine runs an admission policy other than the one this sidecar's ledger runs."""


@dataclass
class Session:
    id: int
    engine_id: str
    lease_s: float
    last_report: float
    report_seq: int = 0
    applied_seq: int = -1
    last_reply: pb.ReportReply | None = None
    last_request: bytes = b""  # to tell a retry from a different report under the same number
    unapplied_idle: dict[int, int] = field(default_factory=dict)  # admission seq -> idle pages
