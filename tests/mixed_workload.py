"""The mixed workload the engine's and the sidecar's property tests share: strict image requests
writing fixed tokens into several labels, beside best-effort chat sharing a system prompt (and
strict chat), the shape that once broke the peak-fit ledger. `run_mixed` drives one through an
engine (debug: the ledger's checks and the second check, engine/safety.py, after every step)
and checks that every request it took finishes, no strict request is preempted and none
stalls."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig, RequestRejected
from kvbank.ledger.client import LedgerClient
from kvbank.modelpool import KvSlot
from kvbank.service_class import ClassPolicy, ServiceClass

PAGE_SIZE = 4
IMAGE_LABELS = {"main": KvSlot(1, 1), "cfg_text": KvSlot(1, 1), "cfg_img": KvSlot(1, 1)}
SYSTEM = [7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7, 6, 7, 8, 7, 9]  # four pages every chat shares

# (arrival step, kind, own prompt tokens, max_tokens, tokens before stop, fixed tokens per label)
Spec = tuple[int, str, int, int, int, tuple[int, int, int]]
request = st.tuples(
    st.integers(0, 60),
    st.sampled_from(["image", "chat", "chat", "strict-chat"]),
    st.integers(1, 10),
    st.integers(2, 16),
    st.integers(1, 20),
    st.tuples(st.integers(0, 12), st.integers(0, 8), st.integers(0, 12)),
)

SPECS = st.lists(request, min_size=20, max_size=90)
# The pools the properties draw: pages, host tier, step budget, speculation, preemption bound.
POOL = {
    "pages": st.integers(16, 48),
    "host_pages": st.sampled_from([0, 8, 32]),
    "budget": st.integers(8, 48),
    "speculative": st.integers(0, 1),
    "max_preemptions": st.integers(1, 3),
}


def mixed_config(
    policy: str, pages: int, host_pages: int, budget: int, speculative: int, max_preemptions: int
) -> EngineConfig:
    """The engine of a drawn `POOL` (debug: every check after every step)."""
    model = CapacityModel(IMAGE_LABELS, PAGE_SIZE, 96, 16, speculative)
    classes = ClassPolicy(max_preemptions=max_preemptions)
    return EngineConfig(
        model, pages, policy, budget, host_pages=host_pages, classes=classes, debug=True
    )


# Found by the engine's property with exclusive pages counted by every holder (shrunk): a strict
# chat holds the system prompt, a best-effort one leases it, and the peak-fit ledger broke.
BREACH: list[Spec] = [
    *[(0, "image", 1, 2, 1, (0, 0, 0))] * 21,
    (0, "image", 2, 10, 8, (0, 0, 0)),
    (0, "image", 9, 11, 11, (0, 0, 1)),
    (0, "image", 1, 15, 15, (0, 0, 0)),
    (0, "image", 1, 2, 2, (0, 0, 0)),
    (0, "image", 1, 7, 4, (0, 0, 4)),
    (0, "image", 1, 7, 7, (0, 0, 0)),
    (0, "chat", 1, 10, 3, (0, 0, 0)),
    (0, "chat", 1, 2, 2, (0, 0, 0)),
    (0, "strict-chat", 1, 7, 7, (0, 0, 0)),
    (46, "image", 1, 16, 2, (0, 0, 0)),
]


def run_mixed(
    config: EngineConfig, specs: list[Spec], backend: LedgerClient | None = None
) -> Engine:
    """Run `specs` to the end through an engine over `backend` (None: the embedded ledger)."""
    runner = VirtualRunner()
    engine = Engine(config, runner, backend)
    taken: dict[str, bool] = {}  # rid -> strict at ingest
    arrivals = sorted(enumerate(specs), key=lambda item: item[1][0])
    for step in range(6000):
        while arrivals and arrivals[0][1][0] <= step:
            index, (_, kind, own, max_tokens, stop, fixed) = arrivals.pop(0)
            rid = f"r{index}"
            if kind == "image":
                prompt = [1000 + 37 * index + i for i in range(own)]
                extra = dict(zip(IMAGE_LABELS, fixed, strict=True))
                labels, cls = None, ServiceClass.STRICT
            else:
                prompt = SYSTEM + [500 + index % 5 + i for i in range(own)]
                extra, labels = {}, frozenset({"main"})
                cls = ServiceClass.BEST_EFFORT if kind == "chat" else ServiceClass.STRICT
            try:
                req = engine.add_request(
                    rid, prompt, max_tokens, extra_tokens=extra, labels=labels, service_class=cls
                )
            except RequestRejected:
                continue
            runner.stop_after(rid, stop)
            taken[rid] = not req.best_effort
        if not arrivals and not engine.has_work():
            break
        engine.step()  # debug: the ledger's deep checks and the second check
        for req in engine.sched.running.values():
            if taken.get(req.rid):
                assert req.preemptions == 0, f"strict {req.rid} was preempted"
    else:
        raise AssertionError("the workload did not finish in 6000 steps")
    assert engine.sched.stats.stalled_rows == 0
    assert getattr(engine.policy, "stalled_steps", 0) == 0
    assert engine.kv.pool.held == 0 and engine.kv.strict_held == 0
    return engine
