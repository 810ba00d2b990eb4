from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hit(_message.Message):
    __slots__ = ("pages", "idle_pages", "sole_pages")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SOLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    idle_pages: int
    sole_pages: int
    def __init__(self, pages: _Optional[int] = ..., idle_pages: _Optional[int] = ..., sole_pages: _Optional[int] = ...) -> None: ...

class PeakShape(_message.Message):
    __slots__ = ("labels", "base", "per_output", "worst", "output_budget", "prefill_chunks")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    PER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    WORST_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    base: _containers.RepeatedScalarFieldContainer[int]
    per_output: _containers.RepeatedScalarFieldContainer[int]
    worst: _containers.RepeatedScalarFieldContainer[int]
    output_budget: int
    prefill_chunks: int
    def __init__(self, labels: _Optional[_Iterable[str]] = ..., base: _Optional[_Iterable[int]] = ..., per_output: _Optional[_Iterable[int]] = ..., worst: _Optional[_Iterable[int]] = ..., output_budget: _Optional[int] = ..., prefill_chunks: _Optional[int] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("rid", "pages", "refusal", "shape", "hold")
    RID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    rid: str
    pages: int
    refusal: str
    shape: PeakShape
    hold: str
    def __init__(self, rid: _Optional[str] = ..., pages: _Optional[int] = ..., refusal: _Optional[str] = ..., shape: _Optional[_Union[PeakShape, _Mapping]] = ..., hold: _Optional[str] = ...) -> None: ...

class EndStep(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class Take(_message.Message):
    __slots__ = ("rid", "pages")
    RID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    rid: str
    pages: int
    def __init__(self, rid: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class Supply(_message.Message):
    __slots__ = ("free", "evictable")
    FREE_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    free: int
    evictable: int
    def __init__(self, free: _Optional[int] = ..., evictable: _Optional[int] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("rid", "prefill_chunks")
    RID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prefill_chunks: int
    def __init__(self, rid: _Optional[str] = ..., prefill_chunks: _Optional[int] = ...) -> None: ...

class Exclusive(_message.Message):
    __slots__ = ("rid", "pages")
    RID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    rid: str
    pages: int
    def __init__(self, rid: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class GiveBack(_message.Message):
    __slots__ = ("rid", "held", "reserved", "shape")
    RID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    held: int
    reserved: int
    shape: PeakShape
    def __init__(self, rid: _Optional[str] = ..., held: _Optional[int] = ..., reserved: _Optional[int] = ..., shape: _Optional[_Union[PeakShape, _Mapping]] = ...) -> None: ...

class BestEffort(_message.Message):
    __slots__ = ("held", "backlog", "arrived")
    HELD_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    held: int
    backlog: int
    arrived: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, held: _Optional[int] = ..., backlog: _Optional[int] = ..., arrived: _Optional[_Iterable[str]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("submit", "cancel", "take", "release", "supply", "advance", "end_step", "start", "exclusive", "give_back", "best_effort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SUPPLY_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_FIELD_NUMBER: _ClassVar[int]
    submit: Submit
    cancel: Cancel
    take: Take
    release: Release
    supply: Supply
    advance: Progress
    end_step: EndStep
    start: Start
    exclusive: Exclusive
    give_back: GiveBack
    best_effort: BestEffort
    def __init__(self, submit: _Optional[_Union[Submit, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., take: _Optional[_Union[Take, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., supply: _Optional[_Union[Supply, _Mapping]] = ..., advance: _Optional[_Union[Progress, _Mapping]] = ..., end_step: _Optional[_Union[EndStep, _Mapping]] = ..., start: _Optional[_Union[Start, _Mapping]] = ..., exclusive: _Optional[_Union[Exclusive, _Mapping]] = ..., give_back: _Optional[_Union[GiveBack, _Mapping]] = ..., best_effort: _Optional[_Union[BestEffort, _Mapping]] = ...) -> None: ...

class Try(_message.Message):
    __slots__ = ("rid", "hit", "no_room", "prefill_chunks")
    RID_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    hit: Hit
    no_room: bool
    prefill_chunks: int
    def __init__(self, rid: _Optional[str] = ..., hit: _Optional[_Union[Hit, _Mapping]] = ..., no_room: _Optional[bool] = ..., prefill_chunks: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("rid", "tokens_per_label", "produced", "chunks_left", "exclusive")
    class TokensPerLabelEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_LABEL_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_LEFT_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    tokens_per_label: _containers.ScalarMap[str, int]
    produced: int
    chunks_left: int
    exclusive: int
    def __init__(self, rid: _Optional[str] = ..., tokens_per_label: _Optional[_Mapping[str, int]] = ..., produced: _Optional[int] = ..., chunks_left: _Optional[int] = ..., exclusive: _Optional[int] = ...) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("rid", "reserved", "held")
    RID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reserved: int
    held: int
    def __init__(self, rid: _Optional[str] = ..., reserved: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("engine_id", "total_pages", "next_seq", "running", "supply", "lease_ms", "policy", "pace")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SUPPLY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PACE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    total_pages: int
    next_seq: int
    running: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    supply: Supply
    lease_ms: int
    policy: str
    pace: LedgerPace
    def __init__(self, engine_id: _Optional[str] = ..., total_pages: _Optional[int] = ..., next_seq: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., supply: _Optional[_Union[Supply, _Mapping]] = ..., lease_ms: _Optional[int] = ..., policy: _Optional[str] = ..., pace: _Optional[_Union[LedgerPace, _Mapping]] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session", "next_seq")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    session: int
    next_seq: int
    def __init__(self, session: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("session", "report_seq", "applied_seq", "events", "tries", "admit", "progress", "room", "in_step", "try_first", "try_hits")
    class TryHitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Hit
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Hit, _Mapping]] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TRIES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    IN_STEP_FIELD_NUMBER: _ClassVar[int]
    TRY_FIRST_FIELD_NUMBER: _ClassVar[int]
    TRY_HITS_FIELD_NUMBER: _ClassVar[int]
    session: int
    report_seq: int
    applied_seq: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    tries: _containers.RepeatedCompositeFieldContainer[Try]
    admit: bool
    progress: _containers.RepeatedCompositeFieldContainer[Progress]
    room: int
    in_step: bool
    try_first: int
    try_hits: _containers.MessageMap[str, Hit]
    def __init__(self, session: _Optional[int] = ..., report_seq: _Optional[int] = ..., applied_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., tries: _Optional[_Iterable[_Union[Try, _Mapping]]] = ..., admit: _Optional[bool] = ..., progress: _Optional[_Iterable[_Union[Progress, _Mapping]]] = ..., room: _Optional[int] = ..., in_step: _Optional[bool] = ..., try_first: _Optional[int] = ..., try_hits: _Optional[_Mapping[str, Hit]] = ...) -> None: ...

class LedgerPace(_message.Message):
    __slots__ = ("page_size", "speculative_tokens", "backfill_depth", "max_advance")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKFILL_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_ADVANCE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    speculative_tokens: int
    backfill_depth: int
    max_advance: int
    def __init__(self, page_size: _Optional[int] = ..., speculative_tokens: _Optional[int] = ..., backfill_depth: _Optional[int] = ..., max_advance: _Optional[int] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("reserved", "hit")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    reserved: int
    hit: Hit
    def __init__(self, reserved: _Optional[int] = ..., hit: _Optional[_Union[Hit, _Mapping]] = ...) -> None: ...

class Refuse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Restored(_message.Message):
    __slots__ = ("reserved", "held")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    reserved: int
    held: int
    def __init__(self, reserved: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("seq", "rid", "session", "admit", "refuse", "restored")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    REFUSE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    rid: str
    session: int
    admit: Admit
    refuse: Refuse
    restored: Restored
    def __init__(self, seq: _Optional[int] = ..., rid: _Optional[str] = ..., session: _Optional[int] = ..., admit: _Optional[_Union[Admit, _Mapping]] = ..., refuse: _Optional[_Union[Refuse, _Mapping]] = ..., restored: _Optional[_Union[Restored, _Mapping]] = ...) -> None: ...

class PoolFigures(_message.Message):
    __slots__ = ("total_pages", "usable_pages", "free", "evictable", "reserved", "held", "outstanding", "headroom")
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    USABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_FIELD_NUMBER: _ClassVar[int]
    total_pages: int
    usable_pages: int
    free: int
    evictable: int
    reserved: int
    held: int
    outstanding: int
    headroom: int
    def __init__(self, total_pages: _Optional[int] = ..., usable_pages: _Optional[int] = ..., free: _Optional[int] = ..., evictable: _Optional[int] = ..., reserved: _Optional[int] = ..., held: _Optional[int] = ..., outstanding: _Optional[int] = ..., headroom: _Optional[int] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("decisions", "waiting", "pool", "stalled", "stalled_steps", "backfilling")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    STALLED_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKFILLING_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    waiting: int
    pool: PoolFigures
    stalled: _containers.RepeatedScalarFieldContainer[str]
    stalled_steps: int
    backfilling: bool
    def __init__(self, decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., waiting: _Optional[int] = ..., pool: _Optional[_Union[PoolFigures, _Mapping]] = ..., stalled: _Optional[_Iterable[str]] = ..., stalled_steps: _Optional[int] = ..., backfilling: _Optional[bool] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("follower_id", "from_seq")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    from_seq: int
    def __init__(self, follower_id: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("follower_id", "seq")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    seq: int
    def __init__(self, follower_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("log_first_seq",)
    LOG_FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    log_first_seq: int
    def __init__(self, log_first_seq: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("rid", "pages")
    RID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    rid: str
    pages: int
    def __init__(self, rid: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("rid", "reserved", "held", "seq")
    RID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reserved: int
    held: int
    seq: int
    def __init__(self, rid: _Optional[str] = ..., reserved: _Optional[int] = ..., held: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class FollowerState(_message.Message):
    __slots__ = ("follower_id", "acked_seq")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    acked_seq: int
    def __init__(self, follower_id: _Optional[str] = ..., acked_seq: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("pool", "waiting", "running", "next_seq", "session", "log_first_seq", "log_length", "followers")
    POOL_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LOG_FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOG_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolFigures
    waiting: _containers.RepeatedCompositeFieldContainer[Waiting]
    running: _containers.RepeatedCompositeFieldContainer[Reservation]
    next_seq: int
    session: int
    log_first_seq: int
    log_length: int
    followers: _containers.RepeatedCompositeFieldContainer[FollowerState]
    def __init__(self, pool: _Optional[_Union[PoolFigures, _Mapping]] = ..., waiting: _Optional[_Iterable[_Union[Waiting, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., next_seq: _Optional[int] = ..., session: _Optional[int] = ..., log_first_seq: _Optional[int] = ..., log_length: _Optional[int] = ..., followers: _Optional[_Iterable[_Union[FollowerState, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("watcher_id", "heartbeat_ms")
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    watcher_id: str
    heartbeat_ms: int
    def __init__(self, watcher_id: _Optional[str] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class RoutingFigures(_message.Message):
    __slots__ = ("ready", "total_pages", "usable_pages", "headroom_pages", "waiting_pages", "best_effort_room_pages", "holds", "held_pages", "version", "worst_request_pages", "room_steps", "room_pages", "pace_advance", "pace_lookahead", "page_size", "best_effort_backlog_pages")
    READY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    USABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    WAITING_PAGES_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_ROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORST_REQUEST_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROOM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PACE_ADVANCE_FIELD_NUMBER: _ClassVar[int]
    PACE_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_BACKLOG_PAGES_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    total_pages: int
    usable_pages: int
    headroom_pages: int
    waiting_pages: _containers.RepeatedScalarFieldContainer[int]
    best_effort_room_pages: int
    holds: int
    held_pages: int
    version: int
    worst_request_pages: int
    room_steps: _containers.RepeatedScalarFieldContainer[int]
    room_pages: _containers.RepeatedScalarFieldContainer[int]
    pace_advance: int
    pace_lookahead: int
    page_size: int
    best_effort_backlog_pages: int
    def __init__(self, ready: _Optional[bool] = ..., total_pages: _Optional[int] = ..., usable_pages: _Optional[int] = ..., headroom_pages: _Optional[int] = ..., waiting_pages: _Optional[_Iterable[int]] = ..., best_effort_room_pages: _Optional[int] = ..., holds: _Optional[int] = ..., held_pages: _Optional[int] = ..., version: _Optional[int] = ..., worst_request_pages: _Optional[int] = ..., room_steps: _Optional[_Iterable[int]] = ..., room_pages: _Optional[_Iterable[int]] = ..., pace_advance: _Optional[int] = ..., pace_lookahead: _Optional[int] = ..., page_size: _Optional[int] = ..., best_effort_backlog_pages: _Optional[int] = ...) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("hold_id", "pages", "ttl_ms", "kind", "max_ahead_pages", "shape")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOW: _ClassVar[HoldRequest.Kind]
        QUEUE: _ClassVar[HoldRequest.Kind]
        BEST_EFFORT: _ClassVar[HoldRequest.Kind]
    NOW: HoldRequest.Kind
    QUEUE: HoldRequest.Kind
    BEST_EFFORT: HoldRequest.Kind
    HOLD_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_AHEAD_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    hold_id: str
    pages: int
    ttl_ms: int
    kind: HoldRequest.Kind
    max_ahead_pages: int
    shape: PeakShape
    def __init__(self, hold_id: _Optional[str] = ..., pages: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., kind: _Optional[_Union[HoldRequest.Kind, str]] = ..., max_ahead_pages: _Optional[int] = ..., shape: _Optional[_Union[PeakShape, _Mapping]] = ...) -> None: ...

class HoldReply(_message.Message):
    __slots__ = ("granted", "figures")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    figures: RoutingFigures
    def __init__(self, granted: _Optional[bool] = ..., figures: _Optional[_Union[RoutingFigures, _Mapping]] = ...) -> None: ...

class UnholdRequest(_message.Message):
    __slots__ = ("hold_id",)
    HOLD_ID_FIELD_NUMBER: _ClassVar[int]
    hold_id: str
    def __init__(self, hold_id: _Optional[str] = ...) -> None: ...

class UnholdReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
