"""Pod mode: each `kvbank serve` is one rank, placed only by the environment the operator renders.

The ranks run as separate processes on loopback, each started the way a pod's engine container
starts: the operator's env, with what its shell prelude computes (rank, rank-0 address) filled
in, and no placement flag.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tp_procs import PROMPTS, ROOT, answers, child_env, free_port, kill_all, stop, wait_healthy

from kvbank.engine.serve.stack import ServeOptions
from kvbank.engine.tp.pod import PodRank, check_split, pod_rank
from kvbank.modelpool import parse_modelpool
from kvbank.operator.render.names import RenderSettings, Workload
from kvbank.operator.render.pods import rank_env

POOL = {
    "apiVersion": "kvbank.dev/v1alpha1",
    "kind": "ModelPool",
    "metadata": {"name": "tiny", "namespace": "team-a"},
    "spec": {
        "model": {"name": "kvbank-builtin", "architecture": {"preset": "llama-3.1-8b"}},
        "replicas": 1,
        "tensorParallel": 2,
        "gpu": {"memoryGiB": 80},
        "kv": {"pageSize": 16, "pages": 256},
        "kvSlots": {"kv": {"prompt": 1, "output": 1}},
        "limits": {"maxSeqLen": 512, "maxTokens": 256},
    },
}


def rendered_env(rank: int, dist_port: int) -> dict[str, str]:
    """The engine container's environment as the operator renders it for rank `rank` of a TP-2
    pool: its literal values, plus what the prelude and the downward API would compute, with
    rank 0 on loopback and the store on a free port (tests run side by side)."""
    pool = parse_modelpool(POOL)
    env = {e["name"]: e["value"] for e in rank_env(pool, RenderSettings(), Workload.STATEFUL_SET)
           if "value" in e}  # fmt: skip
    assert env["KVBANK_WORLD_SIZE"] == "2" and env["KVBANK_DIST_PORT"] == "29500"
    env.update(
        KVBANK_RANK=str(rank),
        KVBANK_GROUP="0",
        KVBANK_RANK0_ADDR="127.0.0.1",
        KVBANK_DIST_PORT=str(dist_port),
        POD_NAME=f"tiny-{rank}",
        POD_NAMESPACE="team-a",
    )
    return env


def serve(
    model: Path, port: int, env: dict[str, str], sidecar: str | None = None, policy: str = "banker"
) -> subprocess.Popen[bytes]:
    """`kvbank serve` with the figures the operator renders for POOL; `sidecar`: the pod's
    sidecar (every pod gets --sidecar; only rank 0 asks it), else the embedded ledger."""
    command = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model),
               "--port", str(port), "--pages", "256", "--page-size", "16", "--max-seq-len", "512",
               "--max-tokens", "256", "--policy", policy]  # fmt: skip
    if sidecar is not None:
        command += ["--sidecar", sidecar]
    return subprocess.Popen(command, env=child_env(env), cwd=ROOT)


def start_pair(
    model: Path, sidecar: str | None = None, policy: str = "banker"
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    dist_port = free_port()
    ports = [free_port(), free_port()]
    ranks = [serve(model, ports[r], rendered_env(r, dist_port), sidecar, policy) for r in range(2)]
    return ranks, [f"http://127.0.0.1:{p}" for p in ports]


def start_sidecar() -> tuple[subprocess.Popen[bytes], str]:
    """Rank 0's sidecar, on loopback (in a pod it listens on the pod's address)."""
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "kvbank.cli", "sidecar", "--listen", address,
               "--metrics-port", "-1"]  # fmt: skip
    return subprocess.Popen(command, env=child_env(), cwd=ROOT), address


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["banker", "peak+backfill"])
def test_two_pods_answer_like_one_engine_and_a_follower_points_to_rank_0(
    builtin_model_dir: Path, policy: str
) -> None:
    """Rank 0 admits through its sidecar, as rendered, without waiting on it; the follower
    replays its decisions (and, under peak-fit, its pins). The single engine with its embedded
    ledger gives the reference answers."""
    single_port = free_port()
    single = serve(builtin_model_dir, single_port, {})
    sidecar, address = start_sidecar()
    ranks, (leader, follower) = start_pair(builtin_model_dir, address, policy)
    try:
        wait_healthy(f"http://127.0.0.1:{single_port}", [single])
        wait_healthy(leader, ranks)
        wait_healthy(follower, ranks)  # the readiness probe every engine container gets
        health = httpx.get(f"{follower}/health").json()
        assert health == {"status": "ok", "rank": 1, "world": 2}
        misdirected = httpx.post(f"{follower}/v1/completions", json={"prompt": "x"})
        assert misdirected.status_code == 421
        error = misdirected.json()["error"]
        assert error["code"] == "not_rank_0"
        assert "rank 1 of a 2-rank" in error["message"] and "rank 0 (127.0.0.1)" in error["message"]
        one = answers(f"http://127.0.0.1:{single_port}")
        assert answers(leader) == one
        assert len(set(one[: len(PROMPTS)])) == len(PROMPTS)
        assert stop(ranks[0]) == 0  # rank 0 stops cleanly and tells its follower
        assert ranks[1].wait(timeout=30) == 0
    finally:
        kill_all(ranks)
        stop(single)
        stop(sidecar)


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_losing_one_pod_ends_the_other_within_seconds(builtin_model_dir: Path, killed: int) -> None:
    ranks, urls = start_pair(builtin_model_dir)
    try:
        wait_healthy(urls[0], ranks)
        wait_healthy(urls[1], ranks)
        ranks[killed].kill()
        started = time.monotonic()
        assert ranks[1 - killed].wait(timeout=20) != 0
        assert time.monotonic() - started < 12  # the process group's timeout is 10 s
    finally:
        kill_all(ranks)


# ---- placement -------------------------------------------------------------------------------

ENV = {"KVBANK_WORLD_SIZE": "2", "KVBANK_RANK": "1", "KVBANK_RANK0_ADDR": "llama-0.llama-ranks"}


def test_the_rendered_environment_places_the_rank() -> None:
    assert pod_rank(None, None, None, ENV) == PodRank(1, 2, "llama-0.llama-ranks:29500")
    assert pod_rank(None, None, None, {**ENV, "KVBANK_DIST_PORT": "4000"}) == PodRank(
        1, 2, "llama-0.llama-ranks:4000"
    )
    flags = pod_rank(0, 4, "10.0.0.1:7", ENV)
    assert flags == PodRank(0, 4, "10.0.0.1:7", "--rank", "--world")


def test_a_group_of_one_is_a_plain_engine() -> None:
    assert pod_rank(None, None, None, {}) is None
    assert pod_rank(None, None, None, {"KVBANK_WORLD_SIZE": "1", "KVBANK_RANK": "0"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**ENV, "KVBANK_RANK": "2"}, "KVBANK_RANK=2 is outside a group of KVBANK_WORLD_SIZE=2"),
        ({**ENV, "KVBANK_RANK": "-1"}, "KVBANK_RANK=-1 is outside"),
        ({**ENV, "KVBANK_RANK": "one"}, "KVBANK_RANK='one' is not an integer"),
        ({**ENV, "KVBANK_WORLD_SIZE": "0"}, "KVBANK_WORLD_SIZE=0: a group has at least 1 rank"),
        ({**ENV, "KVBANK_WORLD_SIZE": "1", "KVBANK_RANK": "1"}, "KVBANK_RANK=1 is outside"),
        ({"KVBANK_WORLD_SIZE": "2"}, "KVBANK_RANK is not set"),
        ({**ENV, "KVBANK_RANK0_ADDR": ""}, "KVBANK_RANK0_ADDR is not set"),
        ({**ENV, "KVBANK_DIST_PORT": "70000"}, "KVBANK_DIST_PORT=70000 is not a TCP port"),
    ],
)
def test_a_bad_placement_names_the_variable_to_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pod_rank(None, None, None, env)


def test_a_flag_is_named_when_it_set_the_figure() -> None:
    with pytest.raises(ValueError, match="--rank=3 is outside a group of KVBANK_WORLD_SIZE=2"):
        pod_rank(3, None, None, ENV)
    with pytest.raises(ValueError, match="--master 'nohost': give rank 0's HOST:PORT"):
        pod_rank(None, None, "nohost", ENV)


def test_a_size_the_heads_cannot_split_names_the_variable(builtin_model_dir: Path) -> None:
    options = ServeOptions(model=str(builtin_model_dir))
    check_split(PodRank(1, 2, "h:1"), options)
    with pytest.raises(ValueError, match="KVBANK_WORLD_SIZE=3 cannot split .*num_attention_heads"):
        check_split(PodRank(1, 3, "h:1"), options)


def test_kvbank_serve_refuses_a_bad_environment_at_once(builtin_model_dir: Path) -> None:
    env = {**rendered_env(1, free_port()), "KVBANK_WORLD_SIZE": "3"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(builtin_model_dir)],
        env=child_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "KVBANK_WORLD_SIZE=3 cannot split" in proc.stderr
    assert "num_attention_heads=8 is not divisible by KVBANK_WORLD_SIZE 3" in proc.stderr
    assert time.monotonic() - started < 30  # no store was waited on
