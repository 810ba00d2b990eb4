"""Ranks from pods, and the status timer's sidecar poll: bounded concurrency,
timeouts, and the Ready / Degraded conditions it writes."""

from __future__ import annotations

import asyncio
from typing import Any

from operator_fakes import FakeCluster
from operator_specs import namespace_doc, pool_doc, stored

from kvbank.operator.live import PoolFigures, poll_sidecars, refresh
from kvbank.operator.ranks import RankedPod, leaders, ranked, ready_groups
from kvbank.operator.reconcile import reconcile
from kvbank.operator.render.names import LWS_API_VERSION, RenderSettings


def sts_pod(ordinal: int, tp: int, ready: bool = True, pool: str = "llama") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{pool}-{ordinal}",
            "namespace": "team-a",
            "labels": {"kvbank.dev/pool": pool, "apps.kubernetes.io/pod-index": str(ordinal)},
        },
        "spec": {
            "containers": [
                {"name": "engine", "env": [{"name": "KVBANK_WORLD_SIZE", "value": str(tp)}]}
            ]
        },
        "status": {
            "podIP": f"10.0.0.{ordinal}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def lws_pod(group: int, index: int) -> dict[str, Any]:
    pod = sts_pod(0, 1)
    pod["metadata"]["name"] = f"llama-{group}-{index}" if index else f"llama-{group}"
    pod["metadata"]["labels"] = {
        "kvbank.dev/pool": "llama",
        "leaderworkerset.sigs.k8s.io/group-index": str(group),
        "leaderworkerset.sigs.k8s.io/worker-index": str(index),
    }
    return pod


FIGURES = PoolFigures(
    pages_total=20000,
    free_pages=15000,
    evictable_pages=1000,
    reserved_pages=4000,
    outstanding_pages=2500,
    queue_depth=3,
)


class FakeSource:
    """Answers per address; records the most sidecars asked at once."""

    def __init__(self, answers: dict[str, Any], delay: float = 0.01) -> None:
        self.answers = answers
        self.delay = delay
        self.active = 0
        self.most_active = 0

    async def status(
        self, address: str, timeout: float, server_name: str | None = None
    ) -> PoolFigures:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            answer = self.answers.get(address, FIGURES)
            if answer == "hang":
                await asyncio.sleep(60)
            await asyncio.sleep(self.delay)
            if isinstance(answer, Exception):
                raise answer
            return answer
        finally:
            self.active -= 1


class TestRanks:
    def test_stateful_set_ordinal_gives_group_and_rank(self) -> None:
        assert ranked(sts_pod(5, 2)) == RankedPod("llama-5", 2, 1, True, "10.0.0.5")

    def test_leader_worker_set_labels_give_group_and_rank(self) -> None:
        position = ranked(lws_pod(3, 1))
        assert position is not None and (position.group, position.rank) == (3, 1)

    def test_a_group_is_ready_only_whole(self) -> None:
        pods = [sts_pod(0, 2), sts_pod(1, 2), sts_pod(2, 2), sts_pod(3, 2, ready=False)]
        assert ready_groups(pods, 2) == 1
        assert [p.name for p in leaders(pods)] == ["llama-0", "llama-2"]


class TestPoll:
    def test_sums_what_answered_and_reports_the_rest(self) -> None:
        ranks = [RankedPod(f"p{i}", i, 0, True, f"10.0.0.{i}") for i in range(4)]
        source = FakeSource({"10.0.0.1:50051": "hang", "10.0.0.2:50051": RuntimeError("reset")})
        poll = asyncio.run(poll_sidecars(source, ranks, 50051, concurrency=2, timeout=0.5))
        assert poll.reporting == 2
        assert poll.figures["pages_total"] == 40000 and poll.figures["queue_depth"] == 6
        assert poll.failures == ("p1: no answer within 0.5s", "p2: RuntimeError: reset")
        assert source.most_active == 2

    def test_with_tls_each_certificate_is_checked_for_its_pods_name(self) -> None:
        pod = sts_pod(0, 1)
        pod["spec"].update(hostname="llama-0", subdomain="llama-ranks")
        rank = ranked(pod)
        assert rank is not None and rank.dns == "llama-0.llama-ranks.team-a.svc"
        asked: list[tuple[str, str | None]] = []

        class Recording(FakeSource):
            async def status(
                self, address: str, timeout: float, server_name: str | None = None
            ) -> PoolFigures:
                asked.append((address, server_name))
                return FIGURES

        source = Recording({})
        asyncio.run(poll_sidecars(source, [rank], 50051, concurrency=1, timeout=1, by_name=True))
        asyncio.run(poll_sidecars(source, [rank], 50051, concurrency=1, timeout=1))
        assert asked == [
            ("10.0.0.0:50051", "llama-0.llama-ranks.team-a.svc"),
            ("10.0.0.0:50051", None),
        ]

    def test_concurrency_is_bounded(self) -> None:
        ranks = [RankedPod(f"p{i}", i, 0, True, f"10.0.1.{i}") for i in range(20)]
        source = FakeSource({})
        poll = asyncio.run(poll_sidecars(source, ranks, 1, concurrency=3, timeout=1.0))
        assert poll.reporting == 20 and source.most_active == 3


class TestRefresh:
    def _cluster(self, *pods: dict[str, Any]) -> tuple[FakeCluster, dict[str, Any]]:
        # Two groups of two ranks need a LeaderWorkerSet (workloads.workload_refusal); the
        # timer reads a group's ranks off ordinals the same way, which these pods carry.
        cluster = FakeCluster(apis=(LWS_API_VERSION,))
        cluster.put(namespace_doc("team-a"))
        cluster.put(stored(pool_doc(replicas=2, tensorParallel=2)))
        asyncio.run(
            reconcile(
                cluster,
                RenderSettings(sidecar_token="t"),
                cluster.one("ModelPool", "llama"),
                now="2026-01-01T00:00:00Z",
            )
        )
        for pod in pods:
            cluster.put(pod)
        return cluster, cluster.one("ModelPool", "llama")

    def _refresh(self, cluster: FakeCluster, doc: dict[str, Any], source: FakeSource):
        return asyncio.run(
            refresh(cluster, source, doc, port=50051, concurrency=4, timeout=0.5, now="t1")
        )

    def test_all_groups_ready_and_reporting(self) -> None:
        cluster, doc = self._cluster(*(sts_pod(i, 2) for i in range(4)))
        self._refresh(cluster, doc, FakeSource({}))
        status = cluster.one("ModelPool", "llama")["status"]
        assert status["readyReplicas"] == 2
        assert status["live"] == {
            "pagesTotal": 40000,
            "freePages": 30000,
            "evictablePages": 2000,
            "reservedPages": 8000,
            "outstandingPages": 5000,
            "queueDepth": 6,
            "sidecarsReporting": 2,
            "sidecarsExpected": 2,
            "updatedAt": "t1",
        }
        kinds = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
        assert kinds == {
            "Accepted": ("True", "Holdable"),
            "Ready": ("True", "GroupsReady"),
            "Degraded": ("False", "AsExpected"),
            "WeightsAvailable": ("True", "InImage"),
        }
        # The traffic Service selects by labels the workload controller stamps: the timer
        # reads pods and writes none of them (the operator has no patch on pods).
        assert [call for call in cluster.calls if call[1].startswith("Pod/")] == []

    def test_a_silent_sidecar_degrades_the_pool(self) -> None:
        cluster, doc = self._cluster(*(sts_pod(i, 2) for i in range(4)))
        self._refresh(cluster, doc, FakeSource({"10.0.0.2:50051": "hang"}))
        status = cluster.one("ModelPool", "llama")["status"]
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "SidecarsUnreachable"
        assert degraded["message"] == "llama-2: no answer within 0.5s"
        assert status["live"]["sidecarsReporting"] == 1

    def test_a_missing_rank_makes_the_group_not_ready(self) -> None:
        cluster, doc = self._cluster(sts_pod(0, 2), sts_pod(1, 2), sts_pod(2, 2))
        self._refresh(cluster, doc, FakeSource({}))
        status = cluster.one("ModelPool", "llama")["status"]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["message"] == "1 of 2 groups ready"

    def test_a_refused_pool_is_not_polled(self) -> None:
        cluster = FakeCluster()
        cluster.put(stored(pool_doc(kv={"pageSize": 16, "pages": 400})))
        doc = cluster.one("ModelPool", "llama")
        doc["status"] = {"conditions": [{"type": "Accepted", "status": "False"}]}
        assert self._refresh(cluster, doc, FakeSource({})) is None
        assert cluster.calls == []
