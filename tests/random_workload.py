"""The random-workload driver the engine and peak-fit property tests share: arrivals at their
step, prompts from a few prefix families, each request stopping after its drawn length."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, RequestOutput, RequestRejected
from kvbank.modelpool import KvSlot

# (arrival step, prompt length, max_tokens or None, tokens before stop, prefix family, text only)
WorkloadRequest = tuple[int, int, int | None, int, int, bool]

# The KV label sets the property tests draw from: one label, a fixed extra label, two growing.
SLOTS = [
    {"main": KvSlot(1, 1)},
    {"main": KvSlot(1, 1), "cross": KvSlot(fixed=6)},
    {"main": KvSlot(1, 1), "cfg": KvSlot(1, 1)},
]

request = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 30),  # prompt tokens
    st.one_of(st.none(), st.integers(1, 20)),  # max_tokens
    st.integers(1, 24),  # where the model would stop
    st.sampled_from([0, 1, 2]),  # prompt family: shared prefixes make hits
    st.booleans(),  # text only (the other labels go to the sink)
)


def drive(
    engine: Engine, runner: VirtualRunner, requests: Sequence[WorkloadRequest], max_steps: int
) -> tuple[set[str], list[RequestOutput]]:
    """Run the workload to the end (or `max_steps`); the ids the engine accepted and every
    finished output. A request the pool can never hold is refused at arrival and not counted."""
    accepted: set[str] = set()
    finished: list[RequestOutput] = []
    arrivals = sorted(enumerate(requests), key=lambda item: item[1][0])
    for step in range(max_steps):
        while arrivals and arrivals[0][1][0] <= step:
            index, (_, prompt_len, max_tokens, stop, family, text_only) = arrivals.pop(0)
            prompt = [100 * family + (i % 9) for i in range(prompt_len)]
            labels = frozenset({"main"}) if text_only else None
            try:
                engine.add_request(f"r{index}", prompt, max_tokens, labels=labels)
            except RequestRejected:
                continue
            runner.stop_after(f"r{index}", stop)
            accepted.add(f"r{index}")
        if not arrivals and not engine.has_work():
            break
        finished.extend(out for out in engine.step() if out.finished)
    return accepted, finished
