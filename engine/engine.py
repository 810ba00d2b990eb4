"""The engine: requests in, tokens out, one `step()` at a time.

    engine = Engine(EngineConfig(model, total_pages), runner, admission_backend)
    engine.add_request("r1", prompt_ids, max_tokens=64)
    while engine.has_work():
        for out in engine.step():
            ...  # out.new_token_ids, out.finished, out.finish_reason

`step()` = schedule -> run -> postprocess. It never blocks on the admission backend: decisions
not ready this step are applied at a later one. Not thread-safe: one caller drives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbank.capacity import (
    CapacityModel,
    Refusal,
    RequestShape,
    count_pages,
    refusal,
    shared_prompt_pages,
)
from kvbank.engine import sequences as groups
from kvbank.engine.admission.registry import make_policy
from kvbank.engine.kv.cache import KVCache
from kvbank.engine.request import FinishReason, Request, Status, build_request
from kvbank.engine.runner import ModelRunner, SamplingParams, StepResult, TokenLogprob
from kvbank.engine.safety import SafetyCheck
from kvbank.engine.scheduler import Scheduler
from kvbank.ledger.client import LedgerClient, embedded
from kvbank.mode import LEDGER_MODE_NAMES, AdmissionMode
from kvbank.service_class import ClassPolicy, ServiceClass, effective_class


@dataclass(frozen=True)
class EngineConfig:
    model: CapacityModel
    total_pages: int  # per rank, the sink page included
    policy: str = "banker"
    max_batch_tokens: int = 2048  # tokens one step may compute, decode rows included
    max_running: int = 256
    host_pages: int = 0  # a host tier for evicted prefix pages; 0: none
    classes: ClassPolicy = field(
        default_factory=ClassPolicy
    )  # default class, preemption bound, victim rule
    debug: bool = False  # deep integrity checks after every step (tests turn it on)


@dataclass(frozen=True)
class RequestOutput:
    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    message: str = ""  # why a request was rejected, or failed (FinishReason.ERROR)
    param: str | None = None  # the request field behind a failure, when one is
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token, when asked


class RequestRejected(ValueError):
    """A request the engine will not take; the message says what was wrong and what to change.
    Nothing was queued. `param` names the request parameter to change (`prompt` or
    `max_tokens`; None when no parameter is at fault), and `refusal` carries the numbers when the
    pool can never hold the request."""

    def __init__(
        self, message: str, param: str | None = None, refusal: Refusal | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.refusal = refusal


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        admission_backend: LedgerClient | None = None,
    ) -> None:
        if admission_backend is None and config.policy == "banker":
            admission_backend = embedded(config.total_pages, debug=config.debug)
        self.config = config
        self.runner = runner
        self.backend = admission_backend
        self.kv = KVCache(config.total_pages, config.model.page_size, config.host_pages)
        self.policy = make_policy(config.policy, admission_backend, config.classes)
        self.sched = Scheduler(
            config.model, self.kv, self.policy, config.max_batch_tokens, config.max_running
        )
        # The second, independent check of the promise, for the policies that make it.
        self.safety: SafetyCheck | None = None
        if config.policy in LEDGER_MODE_NAMES:
            mode = AdmissionMode.parse(config.policy)
            self.safety = SafetyCheck(
                self.kv, config.model, mode.peak, config.max_batch_tokens, config.max_running
            )
        self.steps = 0
        self.last_result: StepResult | None = None
        self.last_rows = 0
        self.last_schedule_s = 0.0
        self._arrivals = 0
        self._known: set[str] = set()
        self._sequences: dict[str, Request] = {}  # the other sequences of groups, by id
        self._aborted: list[RequestOutput] = []

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        rid: str,
        prompt_token_ids: list[int],
        max_tokens: int | None = None,
        *,
        extra_tokens: dict[str, int] | None = None,
        labels: frozenset[str] | None = None,
        sampling: SamplingParams | None = None,
        service_class: ServiceClass | None = None,
        siblings: Sequence[tuple[str, SamplingParams]] = (),
    ) -> Request:
        """Queue a request under `service_class` (None: the pool's default; strict whatever
        is asked when its KV cannot be rebuilt: `Request.service_class` says what it got).
        `siblings`: more sequences sampled from the same prompt, by id and sampling (OpenAI's
        `n` is 1 + their number); they are admitted with it, share its prompt's pages and
        stream under their own ids (engine/sequences.py).

        Raises RequestRejected (a ValueError) for an empty prompt, a max_tokens below 1, a
        duplicate id, or a request the pool can never hold."""
        model = self.config.model
        if not prompt_token_ids:
            raise RequestRejected(
                f"request {rid!r} has an empty prompt; send at least one token", "prompt"
            )
        if max_tokens is not None and max_tokens <= 0:
            raise RequestRejected(
                f"request {rid!r} has max_tokens={max_tokens}; it must be at least 1 "
                f"(or omitted for the model's limit of {model.max_tokens})",
                "max_tokens",
            )
        ids = [rid, *(sibling for sibling, _ in siblings)]
        for seq_id in ids:
            if seq_id in self._known or ids.count(seq_id) > 1:
                raise RequestRejected(f"request id {seq_id!r} is already in use")
        shape = RequestShape(
            len(prompt_token_ids), max_tokens, dict(extra_tokens or {}), labels, len(ids)
        )
        if labels is not None and not labels <= set(model.kv_slots):
            raise RequestRejected(
                f"request {rid!r} names labels {sorted(labels - set(model.kv_slots))} the model "
                f"does not have; it has {sorted(model.kv_slots)}"
            )
        # The one count of this request: the checks below and the request itself read it.
        count = count_pages(model, shape)
        if count.output_tokens < 1:
            raise RequestRejected(
                f"request {rid!r} has a {len(prompt_token_ids)}-token prompt, which leaves no "
                f"room for output under max_seq_len {model.max_seq_len}; shorten the prompt "
                f"to at most {model.max_seq_len - 1} tokens",
                "prompt",
            )
        refused = refusal(model, shape, self.config.total_pages, count)
        if refused is not None:
            self.sched.stats.rejected += 1
            raise RequestRejected(f"request {rid!r}: {refused.message}", refused.param, refused)
        prompt = list(prompt_token_ids)
        # Fixed label tokens (an image's, an audio window's) cannot be recomputed from the
        # prompt; a group of sequences is preempted whole or not at all, so it runs strict, every
        # sequence of it; and best-effort needs a policy that honours classes.
        preemptible = (
            not any(shape.extra_tokens.values()) and not siblings and self.policy.honours_classes
        )
        cls = effective_class(service_class, self.config.classes.default_class, preemptible)
        req = build_request(model, rid, prompt, shape, count, sampling, self._arrivals, cls)
        if siblings:
            others = [
                build_request(model, seq_id, prompt, shape, count, seq_sampling, req.arrival, cls)
                for seq_id, seq_sampling in siblings
            ]
            shared = shared_prompt_pages(model, shape)
            groups.group_of(req, others, shared, model.page_size)
            self._sequences.update((seq.rid, seq) for seq in others)
        self._arrivals += 1
        self._known.update(ids)
        self.sched.enqueue(req)
        self.policy.on_arrival(req)
        return req

    def abort(self, rid: str) -> bool:
        """Stop a request wherever it is; its final output comes with the next step. False when
        the request is unknown or already finished."""
        sched = self.sched
        req = sched.waiting_by_rid.get(rid) or sched.running.get(rid) or self._sequences.get(rid)
        if req is None or (req.group is not None and rid in req.group.done):
            return False
        if req is req.holder and req.status is Status.WAITING:
            sched.cancel(req)
        sched.finish(req, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self.sched.waiting or self.sched.running or self.sched.finished)

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. Returns the new tokens of every row that sampled and
        every request that finished (or was aborted or rejected) since the last step."""
        sched = self.sched
        started = time.perf_counter()
        batch = sched.schedule(self.steps)
        self.last_schedule_s = time.perf_counter() - started  # scheduling and admission
        self.steps += 1
        self.last_rows = len(batch.rows)
        result = self.runner.run(batch) if batch.rows or batch.moves else StepResult({}, 0.0)
        self.last_result = result
        sched.postprocess(result, self.runner.eos_token_id)
        outputs = self._outputs(result)
        if self.config.debug:
            self.check_integrity(deep=True)
        return outputs

    def _outputs(self, result: StepResult) -> list[RequestOutput]:
        sched = self.sched
        done = {f.req.rid: f for f in sched.finished}
        outputs = []
        for rid, row in sched.rows.items():
            if not row.sample or rid in done:
                continue
            token = result.tokens[rid]
            outputs.append(RequestOutput(rid, [token], logprobs=_logprobs(result, rid)))
        for fin in sched.finished:
            rid = fin.req.rid
            sampled = rid in sched.rows and sched.rows[rid].sample and rid in result.tokens
            new = [result.tokens[rid]] if sampled else []
            logprobs = _logprobs(result, rid) if sampled else []
            failure = result.failed.get(rid)
            outputs.append(RequestOutput(rid, new, True, fin.reason, logprobs=logprobs,
                                         message=failure.message if failure else "",
                                         param=failure.param if failure else None))  # fmt: skip
            self._forget(fin.req)
        sched.finished.clear()
        sched.rows = {}
        return outputs

    def _forget(self, req: Request) -> None:
        """A finished sequence's id is free again; a group's first keeps its id (the group's,
        to admission) until the group's last sequence ends."""
        self.runner.release(req.rid)
        self._sequences.pop(req.rid, None)
        group = req.group
        if group is None:
            self._known.discard(req.rid)
            return
        if req is not group.leader:
            self._known.discard(req.rid)
        if group.leader.status is Status.FINISHED:
            self._known.discard(group.leader.rid)
            self.runner.release(group.leader.rid)

    def check_integrity(self, deep: bool = False) -> None:
        """free + held + cached == usable pages; every running request within its worst case;
        the ledger safe and agreeing with the pool's supply; and (`deep`) the second check,
        recomputed from the pool's raw state (engine/safety.py). Raises InvariantBreach."""
        self.sched.check_integrity(deep)
        if deep:
            self.check_safety()

    def check_safety(self) -> None:
        """The second check alone (engine/safety.py): every running strict request can still
        get every page it may need, by the pool's raw state. A no-op for the baselines, which
        promise nothing."""
        if self.safety is not None:
            self.safety.check(self.sched.running, self.sched.waiting)


def _logprobs(result: StepResult, rid: str) -> list[TokenLogprob]:
    found = result.logprobs.get(rid)
    return [] if found is None else [found]
