"""Hypothesis strategies for ModelPool specs: valid ones with small pools, so the capacity rules
bite often, and valid ones with up to two mutations, each breaking one parser rule."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from kvbank.model_spec import PRESETS


def spec_doc(spec: dict[str, Any], name: str = "pool", namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


ARCH = st.one_of(
    st.fixed_dictionaries(
        {"preset": st.sampled_from(sorted(PRESETS))},
        optional={"layers": st.integers(1, 80), "dtype": st.sampled_from(["float16", "fp8"])},
    ),
    st.sampled_from([(8, 8), (16, 4), (32, 8), (32, 1), (64, 8)]).flatmap(
        lambda heads: st.fixed_dictionaries(
            {
                "layers": st.integers(1, 80),
                "attentionHeads": st.just(heads[0]),
                "kvHeads": st.just(heads[1]),
                "headDim": st.sampled_from([64, 128]),
                "parameters": st.floats(1e8, 1e10),
                "dtype": st.sampled_from(["bfloat16", "float16", "fp8"]),
            }
        )
    ),
)
SLOT = st.fixed_dictionaries(
    {"output": st.integers(1, 3)},
    optional={"prompt": st.integers(0, 3), "fixed": st.integers(0, 600)},
)
BASE_SPEC = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries({"name": st.just("m"), "architecture": ARCH}),
        "gpu": st.fixed_dictionaries(
            {"memoryGiB": st.floats(1, 4096)},
            optional={"memoryUtilization": st.floats(0.1, 1), "reservedGiB": st.floats(0, 10)},
        ),
        "kv": st.one_of(
            st.fixed_dictionaries(
                {"pageSize": st.integers(1, 64), "pages": st.integers(2, 5000)},
                optional={"speculativeTokens": st.integers(0, 3), "hostPages": st.integers(0, 99)},
            ),
            st.fixed_dictionaries(
                {"pageSize": st.integers(1, 64), "memoryFraction": st.floats(0.01, 1)}
            ),
        ),
        "kvSlots": st.dictionaries(
            st.sampled_from(["main", "vision"]), SLOT, min_size=1, max_size=2
        ),
        "limits": st.integers(3, 9000).flatmap(
            lambda seq: st.fixed_dictionaries(
                {"maxSeqLen": st.just(seq), "maxTokens": st.integers(1, seq - 1)}
            )
        ),
    },
    optional={
        "replicas": st.integers(0, 4),
        "tensorParallel": st.sampled_from([1, 2, 4, 8, 3]),
        "admission": st.fixed_dictionaries(
            {},
            optional={
                "minConcurrency": st.integers(0, 20),
                "policy": st.sampled_from(["conservative", "peak"]),
                "backfill": st.booleans(),
                "defaultClass": st.sampled_from(["strict", "best-effort"]),
                "order": st.just("fifo"),  # prefix: engine kind vllm's (kvbank.deployment)
                "bestEffort": st.fixed_dictionaries(
                    {},
                    optional={
                        "maxPreemptions": st.integers(0, 64),
                        "victim": st.sampled_from(["newest", "cheapest"]),
                        "estimate": st.sampled_from(["ratio", "learned"]),
                    },
                ),
            },
        ),
    },
)

# (path, value): set the field to the value; value DELETE removes it. Each breaks one rule of
# the parser, except the ones marked valid (an integral float is an integer to both).
DELETE = object()
MUTATIONS: list[tuple[tuple[str, ...], Any]] = [
    *[
        (path, DELETE)
        for path in [
            ("model",),
            ("model", "name"),
            ("model", "architecture"),
            ("gpu",),
            ("gpu", "memoryGiB"),
            ("kv",),
            ("kv", "pageSize"),
            ("kvSlots",),
            ("limits",),
            ("limits", "maxSeqLen"),
            ("limits", "maxTokens"),
        ]
    ],
    (("replicas",), -1),
    (("replicas",), 4097),
    (("replicas",), "2"),
    (("replicas",), 2.0),
    (("replicas",), True),
    (("tensorParallel",), 0),
    (("tensorParallel",), 65),
    (("tensorParallel",), 1.5),
    (("model", "name"), ""),
    (("model", "name"), 7),
    (("model", "architecture"), {}),
    (("model", "architecture"), {"preset": "gpt-9"}),
    (
        ("model", "architecture"),
        {
            "layers": 2,
            "attentionHeads": 8,
            "kvHeads": 16,
            "headDim": 8,
            "parameters": 1e9,
            "dtype": "fp8",
        },
    ),
    (
        ("model", "architecture"),
        {
            "layers": 2,
            "attentionHeads": 8,
            "kvHeads": 3,
            "headDim": 8,
            "parameters": 1e9,
            "dtype": "fp8",
        },
    ),
    (
        ("model", "architecture"),
        {"layers": 2, "attentionHeads": 8, "kvHeads": 8, "headDim": 8, "dtype": "fp8"},
    ),
    (("model", "architecture"), {"preset": "qwen3-8b", "dtype": "int4"}),
    (("model", "architecture"), {"preset": "qwen3-8b", "headDim": 0}),
    (("model", "architecture"), {"preset": "qwen3-8b", "parameters": -1}),
    (("model", "architecture"), {"preset": "qwen3-8b", "layers": 32.0}),
    (("model", "architecture"), {"preset": "qwen3-8b", "size": 7}),
    (("gpu", "memoryGiB"), 0),
    (("gpu", "memoryGiB"), 5000),
    (("gpu", "memoryUtilization"), 0),
    (("gpu", "memoryUtilization"), 1.5),
    (("gpu", "reservedGiB"), -1),
    (("gpu", "cores"), 1),
    (("kv", "pageSize"), 0),
    (("kv", "pageSize"), 1025),
    (("kv", "pages"), 1),
    (("kv", "pages"), (1 << 24) + 1),
    (("kv", "speculativeTokens"), 65),
    (("kv", "memoryFraction"), 0.5),
    (("kv", "memoryFraction"), 0),
    (("kvSlots",), {}),
    (("kvSlots",), {"": {"output": 1}}),
    (("kvSlots",), {"a" * 64: {"output": 1}}),
    (("kvSlots",), {"main": {}}),
    (("kvSlots",), {"main": {"output": 65}}),
    (("kvSlots",), {"main": {"output": 1, "fixed": (1 << 22) + 1}}),
    (("kvSlots",), {"main": {"output": 1, "every": 2}}),
    (("kvSlots",), {f"l{i}": {"output": 1} for i in range(17)}),
    (("limits", "maxSeqLen"), 1),
    (("limits", "maxSeqLen"), (1 << 22) + 1),
    (("limits", "maxTokens"), 0),
    (("limits", "maxTokens"), 9000),
    (("admission", "minConcurrency"), -1),
    (("admission", "policy"), "greedy"),
    (("admission", "backfill"), "yes"),
    (("admission",), "fast"),
    (("admission", "defaultClass"), "flex"),
    (("admission", "defaultClass"), "gold"),
    (("admission", "order"), "lpm"),
    (("admission", "bestEffort"), 2),
    (("admission", "bestEffort", "maxPreemptions"), -1),
    (("admission", "bestEffort", "maxPreemptions"), 65),
    (("admission", "bestEffort", "maxPreemptions"), "2"),
    (("admission", "bestEffort", "victim"), "oldest"),
    (("admission", "bestEffort", "estimate"), "oracle"),
    (("admission", "bestEffort", "budget"), 1),
    (("kv", "hostPages"), -1),
    (("kv", "hostPages"), (1 << 24) + 1),
    (("scheduler",), {}),
]


def _mutate(spec: dict[str, Any], mutation: tuple[tuple[str, ...], Any]) -> None:
    path, value = mutation
    node = spec
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is DELETE:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = copy.deepcopy(value)


def _mutated(pair: tuple[dict[str, Any], list[tuple[tuple[str, ...], Any]]]) -> dict[str, Any]:
    spec, mutations = pair
    for mutation in mutations:
        _mutate(spec, mutation)
    return spec


SPEC = st.tuples(BASE_SPEC, st.lists(st.sampled_from(MUTATIONS), max_size=2)).map(_mutated)


# Valid specs with small pools, so the capacity rules bite often.
VALID_SPEC = st.builds(
    lambda tp, page, pages, seq, frac, spec_tokens, slots, conc, preset: {
        "model": {"name": "m", "architecture": {"preset": preset}},
        "tensorParallel": tp,
        "gpu": {"memoryGiB": 4096},
        "kv": {"pageSize": page, "pages": pages, "speculativeTokens": spec_tokens},
        "kvSlots": slots,
        "limits": {"maxSeqLen": seq, "maxTokens": max(1, int(seq * frac))},
        "admission": {"minConcurrency": conc},
    },
    st.sampled_from([1, 2, 3, 4, 8, 16]),
    st.integers(1, 64),
    st.integers(2, 3000),
    st.integers(2, 5000),
    st.floats(0.0, 0.99),
    st.integers(0, 3),
    st.dictionaries(
        st.sampled_from(["main", "vision", "audio"]),
        st.fixed_dictionaries(
            {"prompt": st.integers(0, 3), "output": st.integers(1, 3), "fixed": st.integers(0, 700)}
        ),
        min_size=1,
        max_size=3,
    ),
    st.integers(0, 12),
    st.sampled_from(sorted(PRESETS)),
)
