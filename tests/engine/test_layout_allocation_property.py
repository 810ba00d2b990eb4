"""The capacity function against what kvbank's engine allocates, for layouts read as a model's
config.json is read: random groups (full attention, sliding window, chunked local, Mamba state),
page sizes, max seq lens, max tokens and step budgets, pooled by `pool_layout`, then a random
workload run through the real scheduler, KV manager and ledger on the virtual clock.

For every request and every step: the pages it holds in each group are never more than
count_pages gives that request there, and never more in all than the worst case `kvbank check`
judges the pool by. And a window's or a chunk's pages (a ring of its cap) always cover what the
step reads there: the window before the step's first new token, or its chunk, through its last."""

from __future__ import annotations

from dataclasses import dataclass

from engine_builders import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbank.capacity import CapacityModel, RequestShape, count_pages, worst_case
from kvbank.capacity.layout import EngineSettings, PoolLayout, pool_layout
from kvbank.capacity.modellayout import Kind, LayerGroup, ModelLayout
from kvbank.engine.request import Request

HEADS = 2
HEAD_DIM = 4
# A tiny Mamba-1 state (2 channels, conv 2, state 2): it raises the page to 16 tokens.
MAMBA_STATE = (("intermediate", 2), ("d_conv", 2), ("d_state", 2))


@st.composite
def layouts(draw: st.DrawFn) -> PoolLayout:
    kinds = draw(
        st.lists(
            st.sampled_from([Kind.FULL, Kind.SLIDING, Kind.CHUNKED, Kind.MAMBA]),
            min_size=1,
            max_size=4,
            unique=True,
        ).filter(lambda ks: any(not k.is_state for k in ks))
    )
    groups = []
    for kind in kinds:
        layers = draw(st.integers(1, 4))
        if kind is Kind.MAMBA:
            groups.append(LayerGroup(kind, layers, state=MAMBA_STATE))
            continue
        window = draw(st.integers(1, 48)) if kind in (Kind.SLIDING, Kind.CHUNKED) else 0
        groups.append(LayerGroup(kind, layers, HEADS, HEAD_DIM, HEAD_DIM, window))
    model = ModelLayout("random", tuple(groups), HEADS, "bfloat16", 1e6, 0.0, 16, 16, None)
    engine = EngineSettings(
        page_size=draw(st.sampled_from([1, 2, 4, 8, 16])),
        max_num_batched_tokens=draw(st.integers(4, 48)),
        speculative_tokens=draw(st.integers(0, 2)),
        batches_in_flight=draw(st.integers(1, 2)),
        hybrid_chunked_local=draw(st.booleans()),
    )
    return pool_layout(model, engine)


@dataclass(frozen=True)
class Arrival:
    prompt: int
    max_tokens: int | None
    output: int  # where the model would stop


def arrivals(max_seq_len: int, max_tokens: int) -> st.SearchStrategy[list[Arrival]]:
    one = st.builds(
        Arrival,
        st.integers(1, max_seq_len - 1),
        st.none() | st.integers(1, max_tokens),
        st.integers(1, max_seq_len),
    )
    return st.lists(one, min_size=1, max_size=6)


@st.composite
def runs(draw: st.DrawFn) -> tuple[PoolLayout, CapacityModel, list[Arrival], str]:
    layout = draw(layouts())
    max_seq_len = draw(st.integers(8, 160))
    max_tokens = draw(st.integers(1, max_seq_len - 1))
    model = layout.capacity_model(max_seq_len, max_tokens)
    policy = draw(st.sampled_from(["banker", "peak+backfill"]))
    return layout, model, draw(arrivals(max_seq_len, max_tokens)), policy


def attention_span(group_kind: Kind, window: int, first: int, last: int, page: int) -> int:
    """Pages a step reads in a window's or chunk's group: from the first position its first new
    token attends to, through its last new token."""
    sliding = group_kind is Kind.SLIDING  # else chunked local: the first new token's chunk
    start = max(0, first - (window - 1)) if sliding else first // window * window
    return last // page - start // page + 1


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(runs())
def test_the_engine_never_allocates_past_the_capacity_function(
    run: tuple[PoolLayout, CapacityModel, list[Arrival], str],
) -> None:
    layout, model, workload, policy = run
    _, worst = worst_case(model)
    # Room for every request at once, so that the run is about what each one takes.
    pages = worst.total * len(workload) + 1
    engine, runner = make_engine(
        pages, policy=policy, model=model, max_batch_tokens=layout.settings.max_num_batched_tokens
    )
    requests: list[tuple[Request, dict[str, int]]] = []
    for index, arrival in enumerate(workload):
        prompt = [2 + (index * 7 + i) % 97 for i in range(arrival.prompt)]
        req = engine.add_request(f"r{index}", prompt, arrival.max_tokens)
        runner.stop_after(req.rid, arrival.output)
        own = count_pages(model, RequestShape(arrival.prompt, arrival.max_tokens))
        requests.append((req, dict(own.per_label)))
    capped = [g for g in layout.groups if g.cap_pages is not None]
    for _ in range(5000):
        if not engine.has_work():
            break
        computed = {req.rid: req.num_computed for req, _ in requests}
        engine.step()
        for req, own in requests:
            held = {label: len(table) for label, table in req.pages.items()}
            assert sum(held.values()) <= worst.total, (req.rid, held, worst)
            for label, count in held.items():
                assert count <= own[label], (req.rid, label, count, own)
            first, last = computed[req.rid], req.num_computed - 1
            if last < first:
                continue  # it wrote nothing this step
            for group in capped:
                span = attention_span(group.kind, group.window, first, last, layout.page_size)
                assert group.cap_pages is not None and span <= group.cap_pages, (
                    req.rid,
                    group,
                    first,
                    last,
                )
    assert not engine.has_work()
