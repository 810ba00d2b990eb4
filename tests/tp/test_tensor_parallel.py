"""Tensor parallelism with real gloo ranks on loopback: TP 2 answers exactly like TP 1, a lost
rank ends its peer within seconds, and a divergence stops every rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvbank.engine.model.stack import ServeOptions
from kvbank.engine.tp import rank_command
from kvbank.engine.tp_sync import FollowerBackend, TPDiverged
from kvbank.ledger import Admitted, Hit

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The page cache", "A ledger of requests", "x", "Many people serve the model"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"a rank exited early with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def _serve(model: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvbank.cli", "serve", "--model", str(model),
               "--port", str(port), "--pages", "256", "--max-seq-len", "512", *extra]  # fmt: skip
    return subprocess.Popen(command, env=_env(), cwd=ROOT)


def _answers(url: str) -> list[str]:
    def ask(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together, as a server would
        answers = list(pool.map(ask, PROMPTS))
    # One after another, sharing a 3-page prefix: the later ones hit the prefix cache, so the
    # follower must replay rank 0's pinned hits exactly.
    shared = "The ledger admits a request only if every admitted request can finish. " * 3
    answers += [ask(shared + tail) for tail in ("First.", "Second one.", "First.")]
    return answers


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.mark.slow
def test_tp2_greedy_output_equals_tp1(builtin_model_dir: Path) -> None:
    port1, port2 = _port(), _port()
    single = _serve(builtin_model_dir, port1)
    pair = _serve(builtin_model_dir, port2, "--tp", "2")
    try:
        _wait_healthy(f"http://127.0.0.1:{port1}", [single])
        _wait_healthy(f"http://127.0.0.1:{port2}", [pair])
        one = _answers(f"http://127.0.0.1:{port1}")
        two = _answers(f"http://127.0.0.1:{port2}")
        assert one == two
        assert len(set(one[: len(PROMPTS)])) == len(PROMPTS)
        hits = [line for line in httpx.get(f"http://127.0.0.1:{port2}/metrics").text.splitlines()
                if line.startswith("kvbank_prefix_hit_tokens_total ")]  # fmt: skip
        assert hits and float(hits[0].split()[1]) > 0
    finally:
        assert _stop(pair) == 0  # rank 0 stops cleanly and tells its follower
        _stop(single)


def _start_ranks(model: Path, port: int) -> list[subprocess.Popen[bytes]]:
    options = ServeOptions(model=str(model), pages=128, max_seq_len=512)
    master = f"127.0.0.1:{_port()}"
    return [
        subprocess.Popen(
            rank_command(rank, 2, master, options, "127.0.0.1", port, timeout_s=5.0),
            env=_env(),
            cwd=ROOT,
        )
        for rank in range(2)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_killing_one_rank_ends_the_other_within_seconds(
    builtin_model_dir: Path, killed: int
) -> None:
    port = _port()
    ranks = _start_ranks(builtin_model_dir, port)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", ranks)
        ranks[killed].kill()
        survivor = ranks[1 - killed]
        started = time.monotonic()
        code = survivor.wait(timeout=15)
        assert code != 0
        assert time.monotonic() - started < 12
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


DIVERGE = textwrap.dedent(
    """
    import os
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from kvbank.engine.tp_sync import Channel, TPDiverged
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
    master = f"127.0.0.1:{_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DIVERGE, str(rank), master],
            env=_env(),
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


def test_a_follower_refuses_a_decision_it_cannot_apply() -> None:
    backend = FollowerBackend(total_pages=11)
    backend.submit("a", 6)
    backend.submit("b", 6)
    backend.expect([[Admitted("b", 0, 6, Hit())]])
    with pytest.raises(TPDiverged, match="admission 0 of 'b' .* its head is 'a'"):
        backend.poll(1)
    fresh = FollowerBackend(total_pages=11)
    fresh.submit("a", 6)
    fresh.submit("b", 6)
    fresh.expect([[Admitted("a", 0, 6, Hit())], [Admitted("b", 1, 6, Hit())]])
    assert [d.rid for d in fresh.poll(1)] == ["a"]
    with pytest.raises(TPDiverged, match="outstanding 6, supply 10"):
        fresh.poll(1)  # 6 + 6 pages do not fit in 10: rank 0 could not have decided this


def test_a_tp_size_the_heads_cannot_split_is_refused_before_any_rank_starts(
    builtin_model_dir: Path,
) -> None:
    from kvbank.engine.tp import run_tp

    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by --tp 3"):
        run_tp(ServeOptions(model=str(builtin_model_dir)), 3, "127.0.0.1", _port())
