"""CapacityPolicy: parsing, namespace selection and quota accounting, with exact messages."""

from __future__ import annotations

import pytest
from operator_specs import policy_doc, pool_doc

from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.policy import (
    CapacityPolicy,
    NamespaceSelector,
    PolicyLimits,
    PoolUsage,
    Requirement,
    matching,
    parse_capacity_policy,
    policy_violations,
)

TEAM_A = {"kubernetes.io/metadata.name": "team-a", "tier": "gold"}


def _policy(name: str, selector: NamespaceSelector | None = None, **limits) -> CapacityPolicy:
    return CapacityPolicy(name, selector or NamespaceSelector({}), PolicyLimits(**limits))


class TestParse:
    def test_every_limit(self) -> None:
        policy = parse_capacity_policy(
            policy_doc(
                "gold",
                {
                    "gpusPerNamespace": 16,
                    "pagesPerPool": 50000,
                    "maxTokens": 4096,
                    "maxSeqLen": 32768,
                    "allowedPageSizes": [32, 16, 16],
                    "minConcurrency": 4,
                },
                {
                    "matchLabels": {"tier": "gold"},
                    "matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["dev"]}],
                },
            )
        )
        assert policy == CapacityPolicy(
            "gold",
            NamespaceSelector({"tier": "gold"}, (Requirement("env", "NotIn", ("dev",)),)),
            PolicyLimits(16, 50000, 4096, 32768, (16, 32), 4),
        )

    def test_no_selector_selects_nothing_and_empty_selects_all(self) -> None:
        none = parse_capacity_policy(policy_doc("p", {"maxTokens": 1}))
        every = parse_capacity_policy(policy_doc("p", {"maxTokens": 1}, {}))
        assert none.selector is None
        assert matching([none], TEAM_A) == []
        assert matching([every], TEAM_A) == [every]

    def test_every_problem_at_once(self) -> None:
        doc = policy_doc(
            "bad",
            {"gpusPerNamespace": -1, "allowedPageSizes": [], "burst": 3},
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
        )
        with pytest.raises(SpecError) as caught:
            parse_capacity_policy(doc)
        assert [str(e) for e in caught.value.errors] == [
            "spec.namespaceSelector.matchExpressions[0].values: must be empty with operator Exists",
            "spec.limits.burst: is not a known field; known: allowedPageSizes, gpusPerNamespace, "
            "maxSeqLen, maxTokens, minConcurrency, pagesPerPool",
            "spec.limits.allowedPageSizes: must list 1 to 16 page sizes from 1 to 1024, got []",
            "spec.limits.gpusPerNamespace: must be from 0 to 1048576, got -1",
        ]


class TestSelector:
    @pytest.mark.parametrize(
        ("requirement", "selected"),
        [
            (Requirement("tier", "In", ("gold", "silver")), True),
            (Requirement("tier", "In", ("bronze",)), False),
            (Requirement("tier", "NotIn", ("bronze",)), True),
            (Requirement("env", "NotIn", ("dev",)), True),  # absent key is not in the set
            (Requirement("tier", "Exists"), True),
            (Requirement("env", "Exists"), False),
            (Requirement("env", "DoesNotExist"), True),
        ],
    )
    def test_expressions(self, requirement: Requirement, selected: bool) -> None:
        assert NamespaceSelector({}, (requirement,)).matches(TEAM_A) is selected

    def test_every_term_must_hold(self) -> None:
        selector = NamespaceSelector({"tier": "gold"}, (Requirement("env", "Exists"),))
        assert not selector.matches(TEAM_A)
        assert selector.matches({**TEAM_A, "env": "prod"})


class TestAccounting:
    def test_gpu_quota_counts_other_pools_replicas_times_tp(self) -> None:
        pool = parse_modelpool(pool_doc(replicas=3, tensorParallel=2))
        others = [PoolUsage("b", 4), PoolUsage("a", 8)]
        (violation,) = policy_violations(
            pool, 20000, [_policy("quota", gpus_per_namespace=16)], others
        )
        assert violation == (
            "CapacityPolicy quota: namespace team-a would use 18 GPUs (a 8, b 4, llama 6 = "
            "replicas 3 x tensorParallel 2) but gpusPerNamespace is 16. Lower replicas to at "
            "most 2, or free GPUs in the namespace's other pools."
        )
        assert (
            policy_violations(pool, 20000, [_policy("quota", gpus_per_namespace=18)], others) == []
        )

    def test_pages_tokens_page_size_and_concurrency_floor(self) -> None:
        pool = parse_modelpool(pool_doc())
        policy = _policy(
            "strict",
            pages_per_pool=10000,
            max_tokens=1024,
            max_seq_len=4096,
            allowed_page_sizes=(32, 64),
            min_concurrency=4,
        )
        assert policy_violations(pool, 20000, [policy], []) == [
            "CapacityPolicy strict: the pool has 20000 pages per rank but pagesPerPool is 10000. "
            "Lower kv.pages so the pool has at most 10000 pages.",
            "CapacityPolicy strict: limits.maxTokens=2048 is above the policy's maxTokens 1024. "
            "Lower limits.maxTokens to at most 1024.",
            "CapacityPolicy strict: limits.maxSeqLen=8192 is above the policy's maxSeqLen 4096. "
            "Lower limits.maxSeqLen to at most 4096.",
            "CapacityPolicy strict: kv.pageSize=16 is not allowed. Use one of 32, 64.",
            "CapacityPolicy strict: admission.minConcurrency=0 is below the policy's floor 4. "
            "Raise admission.minConcurrency to at least 4 (and kv.pages to hold them).",
        ]

    def test_a_namespace_selected_twice_gets_the_most_restrictive_limit(self) -> None:
        pool = parse_modelpool(pool_doc())
        loose = _policy("loose", max_tokens=4096)
        tight = _policy("tight", max_tokens=1024)
        both = policy_violations(pool, 20000, [loose, tight], [])
        assert both == [
            "CapacityPolicy tight: limits.maxTokens=2048 is above the policy's maxTokens 1024. "
            "Lower limits.maxTokens to at most 1024."
        ]
        assert policy_violations(pool, 20000, [tight, loose], []) == both

    def test_zero_quota_leaves_room_for_no_replica(self) -> None:
        pool = parse_modelpool(pool_doc(replicas=1, tensorParallel=4))
        (violation,) = policy_violations(pool, 1, [_policy("none", gpus_per_namespace=2)], [])
        assert "Lower replicas to at most 0" in violation
