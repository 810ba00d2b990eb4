"""Random scenarios, hundreds of requests each, through `kvbank bench`'s own runner with the
second check (engine/safety.py) after every step, under every ledger policy: the search for a
mix that breaks the promise, wider than the properties' small pools.

    python benchmarks/guarantee_fuzz.py [--seeds 1000 1030] [--requests 900] [--policy all]

Each seed draws a model of one to three labels (full attention, a sliding window, a fixed-size
state), one to four request classes (strict or best-effort, a shared prefix on one of two
system prompts, fixed label tokens on strict ones, output to one label only, max_tokens from 64
to none), a pool of 48 to 300 pages with or without a host tier, 0 to 2 speculative tokens, a
cost model (how fast steps run against arrivals), and an open loop (2 to 32 requests/s) or a
closed one (4 to 64 clients). A line per run: the seed,
the policy, `ok` or `BAD`, then completed, rejected, failed, hung, breaches and strict
preemptions, seconds, and why it stopped. A run is BAD when a request hangs, the ledger's or the
second check's invariant breaks, a strict request is preempted, or a request is unaccounted
for. A draw whose pool holds none of its requests (all refused at arrival) is said to be
vacuous and skipped. The drawn scenario is left in `--out` (a temp folder by default) to rerun with
`kvbank bench --scenario FILE --policy POLICY --check`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvbank.engine.bench.scenario import ScenarioError, load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.mode import LEDGER_MODE_NAMES


def _label(r: random.Random, first: bool) -> dict[str, int]:
    kind = "plain" if first else r.choice(["plain", "plain", "plain", "window", "state"])
    if kind == "window":
        return {"prompt": 1, "output": 1, "sliding_window": r.choice([64, 128, 256])}
    if kind == "state":
        return {"fixed": r.choice([16, 32])}
    return {"prompt": r.choice([1, 1, 2]), "output": r.choice([1, 1, 2])}


def _class(r: random.Random, index: int, plain: list[str]) -> dict[str, Any]:
    strict = r.random() < 0.67
    cls: dict[str, Any] = {
        "name": f"c{index}",
        "weight": r.choice([1, 2, 3]),
        "service_class": "strict" if strict else "best-effort",
    }
    if r.random() < 0.5:
        prefix = r.choice([32, 64, 128, 256])
        cls["shared_prefix"] = r.choice(["sys-a", "sys-b"])
        cls["shared_prefix_tokens"] = prefix
        cls["prompt_tokens"] = {"min": prefix + 1, "max": prefix + r.choice([8, 64, 200])}
    else:
        cls["prompt_tokens"] = {"min": r.choice([1, 10, 40]), "max": r.choice([60, 200, 500])}
    if strict and len(plain) > 1 and r.random() < 0.4:  # a fixed label's KV is always strict
        cls["fixed_label_tokens"] = {label: r.choice([0, 16, 32, 64, 128]) for label in plain}
    if len(plain) > 1 and r.random() < 0.3:
        cls["only_labels"] = [plain[0]]
    budget = r.choice([None, 64, 128, 256, 512])
    cls["max_tokens"] = budget
    most = budget or 512
    cls["output_tokens"] = {
        "min": r.choice([1, 4, 16]),
        "max": max(16, r.choice([most, most // 2, most * 2])),
    }
    return cls


def draw(seed: int, requests: int) -> dict[str, Any]:
    """The scenario of `seed`, as a `kvbank bench` YAML document."""
    r = random.Random(seed)
    labels = {f"l{i}": _label(r, i == 0) for i in range(r.choice([1, 1, 2, 3]))}
    plain = [name for name, slot in labels.items() if "fixed" not in slot]
    classes = [_class(r, i, plain) for i in range(r.choice([1, 2, 3, 4]))]
    workload: dict[str, Any] = {"requests": requests, "seed": seed, "classes": classes}
    if r.random() < 0.7:
        workload["rate_per_s"] = r.choice([2, 4, 8, 16, 32])
    else:
        workload["concurrency"] = r.choice([4, 8, 24, 64])
    return {
        "name": f"fuzz-{seed}",
        "about": "a random mix drawn by benchmarks/guarantee_fuzz.py",
        "pool": {
            "pages": r.choice([48, 64, 96, 128, 200, 300]),
            "page_size": 16,
            "host_pages": r.choice([0, 0, 128, 512]),
        },
        "model": {
            "kv_slots": labels,
            "max_seq_len": 2048,
            "max_tokens_default": r.choice([256, 1024]),
            "speculative_tokens": r.choice([0, 0, 1, 2]),
            "tp": 1,
        },
        # How fast steps run against arrivals: a quicker engine drains the queue between them.
        "cost_model": {
            "step_base_ms": r.choice([4, 8, 16]),
            "prefill_ms_per_token": r.choice([0.01, 0.02, 0.05]),
            "decode_ms_per_row": r.choice([0.02, 0.05]),
            "attn_ms_per_page": 0.002,
            "host_ms_per_page": r.choice([0.04, 0.08, 0.2]),
        },
        "time_limit_s": 7200,
        "workload": workload,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, default=[1000, 1030], metavar=("FROM", "TO"))
    parser.add_argument("--requests", type=int, default=900)
    parser.add_argument("--policy", default="all", help="a ledger policy, a comma list, or all")
    parser.add_argument("--out", type=Path, help="where the drawn scenarios go")
    args = parser.parse_args()
    policies = LEDGER_MODE_NAMES if args.policy == "all" else tuple(args.policy.split(","))
    out = args.out or Path(tempfile.mkdtemp(prefix="kvbank-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for seed in range(*args.seeds):
        path = out / f"fuzz-{seed}.yaml"
        path.write_text(yaml.safe_dump(draw(seed, args.requests)))
        try:
            scenario = load_scenario(path)
        except ScenarioError as exc:
            print(seed, "invalid", exc, flush=True)
            continue
        for policy in policies:
            started = time.monotonic()
            m = run_policy(scenario, policy, check=True).metrics
            if m["rejected"] == args.requests:  # refused at arrival, as they must be
                print(seed, "vacuous: the pool holds none of the drawn requests", flush=True)
                break
            strict = (m.get("preemptions_by_class") or {}).get("strict", 0)
            lost = m["completed"] + m["rejected"] + m["failed"] != args.requests
            broken = bool(m["hung"] or m["invariant_breaches"] or strict or lost)
            bad += broken
            print(seed, policy, "BAD" if broken else "ok", m["completed"], m["rejected"],
                  m["failed"], m["hung"], m["invariant_breaches"], strict,
                  f"{time.monotonic() - started:.1f}s", m["stopped"], flush=True)  # fmt: skip
    print(f"{bad} bad run(s); scenarios in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
