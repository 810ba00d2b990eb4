"""The webhook's decisions: exactly `kvbank check`'s verdict and lines, plus the policy, over
many specs; the neighbourhood it judges a pool in; and what an update may skip."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import io
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, policy_doc, pool_doc, stored
from operator_strategies import SPEC, VALID_SPEC, spec_doc

from kvbank import check
from kvbank.operator.admission import (
    Neighbourhood,
    decide,
    message,
    neighbourhood,
    review,
    review_policy,
    usage,
)
from kvbank.operator.policy import PoolUsage, parse_capacity_policy

NOBODY = Neighbourhood({}, [], [])


def _check(doc: dict[str, Any]) -> tuple[int, list[str]]:
    """`kvbank check` on the document: its exit code and its '  - ' lines."""
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pool.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = check.run(argparse.Namespace(files=[str(path)]))
    lines = (out.getvalue() + err.getvalue()).splitlines()
    return code, [line.removeprefix("  - ") for line in lines if line.startswith("  - ")]


def _review(cluster: FakeCluster, doc: dict[str, Any], old: dict[str, Any] | None = None):
    return asyncio.run(review(cluster, doc, old))


class TestDecide:
    def test_holdable(self) -> None:
        decision = decide(pool_doc(), NOBODY)
        assert decision.ok and decision.reason == "Holdable"
        assert decision.held is not None and decision.held.worst_concurrency == 38

    def test_unholdable_lists_every_violation_with_what_to_change(self) -> None:
        doc = pool_doc(kv={"pageSize": 16, "pages": 400, "speculativeTokens": 1}, tensorParallel=3)
        decision = decide(doc, NOBODY)
        assert decision.reason == "Unholdable"
        assert decision.violations[0] == (
            "kv.pages=400 cannot hold one worst-case request (513 pages: maxSeqLen 8192 + 1 "
            "speculative token at pageSize 16). Raise kv.pages to at least 514, or lower "
            "limits.maxSeqLen to at most 6383."
        )
        assert len(decision.violations) == 3  # + attention heads and KV heads split

    def test_malformed_spec_names_every_field(self) -> None:
        doc = pool_doc(replicas=-1, limits={"maxSeqLen": 100, "maxTokens": 100})
        decision = decide(doc, NOBODY)
        assert decision.reason == "InvalidSpec" and decision.pool is None
        assert decision.violations == (
            "spec.replicas: must be from 0 to 4096, got -1",
            "spec.limits.maxTokens: must be below maxSeqLen (100) so a prompt fits, got 100",
        )

    def test_missing_architecture(self) -> None:
        doc = pool_doc(model={"name": "m"})
        (violation,) = decide(doc, NOBODY).violations
        assert violation.startswith("spec.model.architecture: is missing; give layers")

    def test_absurd_numbers(self) -> None:
        doc = pool_doc(kv={"pageSize": 10**12, "pages": -5})
        assert decide(doc, NOBODY).violations == (
            "spec.kv.pageSize: must be from 1 to 1024, got 1000000000000",
            "spec.kv.pages: must be from 2 to 16777216, got -5",
        )

    def test_policy_violations_come_after_holdability_in_one_message(self) -> None:
        policy = parse_capacity_policy(policy_doc("cap", {"maxTokens": 1024}, {}))
        doc = pool_doc(kv={"pageSize": 16, "pages": 400, "speculativeTokens": 1})
        decision = decide(doc, Neighbourhood({}, [policy], []))
        assert len(decision.violations) == 2
        assert decision.violations[1].startswith("CapacityPolicy cap: limits.maxTokens=2048")
        text = message("team-a", "llama", decision)
        assert text.startswith("ModelPool team-a/llama: 2 violation(s):\n  - kv.pages=400")
        assert text.endswith("Lower limits.maxTokens to at most 1024.")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(SPEC, VALID_SPEC))
def test_webhook_accepts_exactly_what_kvbank_check_accepts(spec: dict[str, Any]) -> None:
    doc = spec_doc(spec)
    code, lines = _check(copy.deepcopy(doc))
    refusal = _review(FakeCluster(), copy.deepcopy(doc))
    assert (refusal is None) == (code == 0)
    if refusal is not None:
        assert refusal.split("\n  - ")[1:] == lines


class TestNeighbourhood:
    def _cluster(self) -> FakeCluster:
        cluster = FakeCluster()
        cluster.put(namespace_doc("team-a", {"tier": "gold"}))
        cluster.put(policy_doc("gold", {"gpusPerNamespace": 4}, {"matchLabels": {"tier": "gold"}}))
        cluster.put(policy_doc("silver", {"maxTokens": 8}, {"matchLabels": {"tier": "silver"}}))
        return cluster

    def test_reads_labels_policies_and_other_pools(self) -> None:
        cluster = self._cluster()
        cluster.put(stored(pool_doc("early", replicas=2), created="2026-01-01T00:00:00Z"))
        around = asyncio.run(neighbourhood(cluster, stored(pool_doc()), earlier_only=False))
        assert around.namespace_labels == {"tier": "gold", "kubernetes.io/metadata.name": "team-a"}
        assert sorted(p.name for p in around.policies) == ["gold", "silver"]
        assert around.others == [PoolUsage("early", 2)]

    def test_a_quota_race_refuses_the_later_pool_only(self) -> None:
        cluster = self._cluster()
        first = stored(pool_doc("first", replicas=3), uid="u1", created="2026-01-01T00:00:01Z")
        second = stored(pool_doc("second", replicas=3), uid="u2", created="2026-01-01T00:00:02Z")
        cluster.put(first)
        cluster.put(second)
        for doc, refused in ((first, False), (second, True)):
            around = asyncio.run(neighbourhood(cluster, doc, earlier_only=True))
            assert (not decide(doc, around).ok) is refused, doc["metadata"]["name"]

    def test_refused_and_malformed_pools_hold_no_gpus(self) -> None:
        refused = stored(pool_doc("refused", replicas=4))
        refused["status"] = {"conditions": [{"type": "Accepted", "status": "False"}]}
        broken = stored(pool_doc("broken", replicas=-3))
        counted = stored(pool_doc("counted", replicas=1))
        assert usage([refused, broken, counted], "me", None) == [PoolUsage("counted", 1)]

    def test_a_malformed_policy_is_skipped_not_fatal(self) -> None:
        cluster = self._cluster()
        cluster.put(policy_doc("broken", {"gpusPerNamespace": "many"}, {}))
        around = asyncio.run(neighbourhood(cluster, stored(pool_doc()), earlier_only=False))
        assert sorted(p.name for p in around.policies) == ["gold", "silver"]


class TestReview:
    def test_over_quota_is_refused_with_the_policy_named(self) -> None:
        cluster = FakeCluster()
        cluster.put(namespace_doc("team-a"))
        cluster.put(policy_doc("quota", {"gpusPerNamespace": 1}, {}))
        refusal = _review(cluster, pool_doc(replicas=2))
        assert refusal is not None
        assert "CapacityPolicy quota: namespace team-a would use 2 GPUs" in refusal

    def test_an_update_that_leaves_the_spec_alone_is_not_judged(self) -> None:
        bad = pool_doc(kv={"pageSize": 16, "pages": 400})
        relabelled = copy.deepcopy(bad)
        relabelled["metadata"]["labels"] = {"team": "a"}
        cluster = FakeCluster()
        assert _review(cluster, relabelled, old=bad) is None
        assert cluster.calls == []  # nothing was even read
        assert _review(cluster, bad, old=pool_doc()) is not None

    def test_shrinking_a_running_pool_is_judged_like_any_spec(self) -> None:
        """Shrinking rolls the pods (docs/operator.md): each pod's ledger lives and dies with
        it, so only the new spec's own holdability matters."""
        old = stored(pool_doc())
        smaller = stored(pool_doc(kv={"pageSize": 16, "pages": 1000, "speculativeTokens": 1}))
        assert _review(FakeCluster(), smaller, old=old) is None


class TestSlowJudgement:
    def test_a_spec_too_slow_to_judge_is_refused_in_time_and_the_loop_keeps_serving(
        self, monkeypatch
    ) -> None:
        import time

        from kvbank.operator import admission

        monkeypatch.setattr(admission, "decide", lambda doc, around: time.sleep(1.0))
        ticks = []

        async def both():
            async def ticker():
                for _ in range(5):
                    await asyncio.sleep(0.02)
                    ticks.append(1)

            tick = asyncio.create_task(ticker())
            refusal = await review(FakeCluster(), pool_doc(), None, timeout=0.2)
            await tick
            return refusal

        started = time.perf_counter()
        refusal = asyncio.run(both())
        assert refusal is not None and "could not be judged within 0.2 s" in refusal
        assert "Raise kv.pageSize or lower limits.maxSeqLen" in refusal
        assert len(ticks) == 5  # the event loop was not blocked while judging
        assert time.perf_counter() - started < 5.0  # the 1 s judgement, not more


class TestReviewPolicy:
    def test_lists_every_problem(self) -> None:
        refusal = review_policy(policy_doc("p", {"maxTokens": 0, "pagesPerPool": 1}))
        assert refusal == (
            "CapacityPolicy p: 2 violation(s):\n"
            "  - spec.limits.pagesPerPool: must be from 2 to 16777216, got 1\n"
            "  - spec.limits.maxTokens: must be from 1 to 4194304, got 0"
        )
        assert review_policy(policy_doc("p", {"maxTokens": 10})) is None


class TestHostileSpecs:
    """What `kvbank check` refuses with exit 2 the webhook refuses with the same lines, never a
    traceback: a number past float's range, a name Kubernetes cannot carry."""

    def test_a_number_of_400_digits_is_a_refusal(self) -> None:
        doc = pool_doc(gpu={"memoryGiB": 10**400, "memoryUtilization": 0.9, "reservedGiB": 2})
        refusal = _review(FakeCluster(), doc)
        assert refusal is not None
        [line] = refusal.split("\n  - ")[1:]
        assert line.startswith("spec.gpu.memoryGiB: must be above 0 and up to 4096, got ")
        assert len(line) < 200

    def test_a_name_kubernetes_cannot_carry_is_a_refusal(self) -> None:
        refusal = _review(FakeCluster(), pool_doc(name="Llama_8B", namespace="Team A"))
        assert refusal is not None
        lines = refusal.split("\n  - ")[1:]
        assert [line.split(":")[0] for line in lines] == ["metadata.name", "metadata.namespace"]
