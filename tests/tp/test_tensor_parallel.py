"""Tensor parallelism with real gloo ranks on loopback: TP 2 answers exactly like TP 1, a lost
rank ends its peer within seconds, and a divergence stops every rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from tp_procs import PROMPTS, ROOT, answers, child_env, free_port, kill_all, stop, wait_healthy

from kvbank.engine.serve.stack import ServeOptions
from kvbank.engine.tp.launch import rank_command
from kvbank.engine.tp.sync import FollowerBackend, Headroom, TPDiverged, Tried
from kvbank.ledger import Admitted, Hit


def _serve(model: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model),
               "--port", str(port), "--pages", "256", "--max-seq-len", "512", *extra]  # fmt: skip
    return subprocess.Popen(command, env=child_env(), cwd=ROOT)


@pytest.mark.slow
def test_tp2_greedy_output_equals_tp1(builtin_model_dir: Path) -> None:
    port1, port2 = free_port(), free_port()
    single = _serve(builtin_model_dir, port1)
    pair = _serve(builtin_model_dir, port2, "--tp", "2")
    try:
        wait_healthy(f"http://127.0.0.1:{port1}", [single])
        wait_healthy(f"http://127.0.0.1:{port2}", [pair])
        one = answers(f"http://127.0.0.1:{port1}")
        two = answers(f"http://127.0.0.1:{port2}")
        assert one == two
        assert len(set(one[: len(PROMPTS)])) == len(PROMPTS)
        hits = [line for line in httpx.get(f"http://127.0.0.1:{port2}/metrics").text.splitlines()
                if line.startswith("kvbank_prefix_hit_tokens_total ")]  # fmt: skip
        assert hits and float(hits[0].split()[1]) > 0
    finally:
        assert stop(pair) == 0  # rank 0 stops cleanly and tells its follower
        stop(single)


def _start_ranks(model: Path, port: int) -> list[subprocess.Popen[bytes]]:
    options = ServeOptions(model=str(model), pages=128, max_seq_len=512)
    master = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            rank_command(rank, 2, master, options, "127.0.0.1", port, timeout_s=5.0),
            env=child_env(),
            cwd=ROOT,
        )
        for rank in range(2)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_killing_one_rank_ends_the_other_within_seconds(
    builtin_model_dir: Path, killed: int
) -> None:
    port = free_port()
    ranks = _start_ranks(builtin_model_dir, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ranks)
        ranks[killed].kill()
        survivor = ranks[1 - killed]
        started = time.monotonic()
        code = survivor.wait(timeout=15)
        assert code != 0
        assert time.monotonic() - started < 12
    finally:
        kill_all(ranks)


DIVERGE = textwrap.dedent(
    """
    import os
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from kvbank.engine.tp.sync import Channel, TPDiverged
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://" + sys.argv[2], rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    channel = Channel(rank, 2)
    channel.agree("same", 0)
    try:
        channel.agree("3 rows" if rank == 0 else "2 rows", 1)
    except TPDiverged as exc:
        print(exc, flush=True)
        os._exit(3)  # as a rank does: gloo's threads can abort a normal interpreter exit
    os._exit(0)
    """
)


def test_a_batch_mismatch_stops_every_rank_with_both_digests() -> None:
    master = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DIVERGE, str(rank), master],
            env=child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [3, 3]
    for out in outputs:
        assert "diverged at plan 1: rank 0: 3 rows; rank 1: 2 rows" in out


def test_a_tp_size_the_heads_cannot_split_is_refused_before_any_rank_starts(
    builtin_model_dir: Path,
) -> None:
    from kvbank.engine.tp.launch import run_tp

    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by --tp 3"):
        run_tp(ServeOptions(model=str(builtin_model_dir)), 3, "127.0.0.1", free_port())


def test_a_follower_replays_rank_0s_answers_to_its_questions_in_order() -> None:
    backend = FollowerBackend(late=False)
    admitted = Admitted("a", 0, 6, Hit())
    backend.expect([Tried("a", admitted, False), Tried("b", None, True), Tried("c", None, True)])
    assert backend.try_admit("a", Hit()) == admitted
    assert (backend.try_admit("b", Hit()), backend.backfilling()) == (None, True)
    with pytest.raises(TPDiverged, match="asked about 'd' where rank 0 asked 'c'"):
        backend.try_admit("d", Hit())
    with pytest.raises(TPDiverged, match="asked for a Tried answer where rank 0's next was None"):
        backend.try_admit("e", Hit())


def test_a_follower_of_a_late_client_replays_rank_0s_answers_in_order_and_nothing_else() -> None:
    backend = FollowerBackend(late=True)
    assert backend.later is backend and FollowerBackend(late=False).later is None
    decision = Admitted("a", 0, 6, Hit(2, 0, 0))
    backend.expect([[], True, Headroom(5), [decision]])
    assert backend.collect() == []
    assert backend.settled() is True
    assert backend.headroom() == 5  # the follower pins with rank 0's budget
    assert backend.poll(3) == [decision]
    backend.expect([True])
    with pytest.raises(
        TPDiverged, match="asked for a Headroom answer where rank 0's next was True"
    ):
        backend.headroom()
    backend.expect([[decision]])
    with pytest.raises(TPDiverged, match="never applied here"):
        backend.expect([])
