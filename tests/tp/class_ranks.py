"""One rank of a two-rank gloo group that runs strict and best-effort requests through the
real TP sync (engine/tp/sync.py): rank 0 adds the requests and journals them (with the class
each asked for), every rank steps its own engine, the ranks agree on every batch's digest (host
copies included), and followers append rank 0's tokens. Rank 0 prints each request's output
and preemptions as JSON. Run by tests/tp/test_tp_classes.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.runner import StepBatch
from kvbank.engine.tp.launch import _journal_requests
from kvbank.engine.tp.sync import Added, Channel, FollowerRunner, LeaderRunner, Plan
from kvbank.modelpool import KvSlot
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim

BE = ServiceClass.BEST_EFFORT


class Forward(VirtualRunner):
    def forward(self, batch: StepBatch) -> None:
        self.run(batch)


Spec = tuple[str, list[int], int, ServiceClass | None, int]


def requests(step: int) -> list[Spec]:
    """The requests arriving at `step` as (rid, prompt, max_tokens, class, stop after):
    best-effort ones first, strict ones later, while best-effort ones hold the pool; shared
    prefixes."""
    out = []
    for i in range(24):
        strict = i % 3 == 0
        if (5 + 9 * (i // 3) if strict else 0) != step:
            continue
        length = 36 + i % 4 if strict else 6 + 3 * (i % 7)
        prompt = [7 * (i % 3) + j % 5 for j in range(length)]
        out.append((f"r{i}", prompt, 4 if strict else 20, None if strict else BE, 14 + i % 7))
    return out


def drive(engine: Engine, inner: Forward, after_step: Any = None) -> dict[str, Any]:
    """Add the requests as they arrive and step to the end."""
    outputs: dict[str, list[int]] = {}
    reqs = {}
    step = 0
    while step <= 80 or engine.has_work():
        for rid, prompt, max_tokens, cls, stop in requests(step):
            reqs[rid] = engine.add_request(rid, prompt, max_tokens, service_class=cls)
            inner.stop_after(rid, stop)
            outputs[rid] = []
        for out in engine.step():
            outputs[out.rid].extend(out.new_token_ids)
        if after_step is not None:
            after_step()
        step += 1
    return {"outputs": outputs, "preempted": {rid: r.preemptions for rid, r in reqs.items()}}


def single(victim: str) -> dict[str, Any]:
    """The same requests on one rank, for comparison."""
    engine, inner = build(victim)
    return drive(engine, inner)


def build(victim: str) -> tuple[Engine, Forward]:
    model = CapacityModel({"main": KvSlot(prompt=1, output=1)}, 4, 64, 20, 1)
    classes = ClassPolicy(victim=Victim(victim), estimate=Estimate.RATIO)
    config = EngineConfig(model, 20, "peak+backfill", 32, host_pages=16, classes=classes,
                          debug=True)  # fmt: skip
    inner = Forward(seed=3)
    return Engine(config, inner), inner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--victim", default="newest")
    args = parser.parse_args()
    addr, port = args.master.rsplit(":", 1)
    store = dist.TCPStore(addr, int(port), 2, args.rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=30))  # fmt: skip
    channel = Channel(args.rank, 2)
    engine, inner = build(args.victim)
    if args.rank == 0:
        journal: list[Any] = []
        seq = [0]

        def make_plan(kind: str) -> Plan:
            plan = Plan(seq[0], kind, list(journal))
            seq[0] += 1
            journal.clear()
            return plan

        _journal_requests(engine, journal)
        leader = LeaderRunner(inner, channel, make_plan)
        engine.runner = leader
        leader.synced = False

        def after_step() -> None:
            if not leader.synced:  # a step with no rows: the followers step too
                plan = make_plan("step")
                channel.broadcast(plan)
                channel.agree("no rows", plan.seq)
            leader.synced = False

        result = drive(engine, inner, after_step)
        channel.broadcast(make_plan("stop"))
        print(json.dumps(result))
        return
    follower = FollowerRunner(inner, channel)
    engine.runner = follower
    while True:
        plan = channel.broadcast(None)
        if plan.kind == "stop":
            return
        for entry in plan.journal:
            if isinstance(entry, Added):
                engine.add_request(entry.rid, entry.prompt, entry.max_tokens,
                                   service_class=entry.service_class)  # fmt: skip
        follower.synced = False
        follower.seq = plan.seq
        engine.step()
        if not follower.synced:
            channel.agree("no rows", plan.seq)


if __name__ == "__main__":
    main()
    # As a rank does (kvbank.engine.tp.launch._exit): a process group's destructor can abort
    # or hang once the peer is gone; everything is decided and printed by now.
    sys.stdout.flush()
    os._exit(0)
