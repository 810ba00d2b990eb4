"""What counting n sequences as one prompt plus n outputs buys: the same burst of requests for
n completions each, run through the real engine (virtual-clock runner, real scheduler, cache and
ledger) two ways in the same run: as groups (`n` sequences sharing the prompt's pages, one
reservation) and as n separate requests per prompt (each reserving its whole prompt). Prints,
per policy, the virtual time to finish the burst, the most sequences decoding at once and the
median time to first token, with the ratio of the two ways.

    .venv/bin/python benchmarks/n_sequences.py [--prompts 24] [--n 4] [--prompt-tokens 600]
"""

from __future__ import annotations

import argparse
import statistics

from kvbank.capacity import CapacityModel
from kvbank.engine.bench.virtual import VirtualRunner
from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.runner import SamplingParams
from kvbank.modelpool import KvSlot


def run(policy: str, args: argparse.Namespace, grouped: bool) -> tuple[float, int, float]:
    model = CapacityModel({"main": KvSlot(1, 1)}, 16, 4096, args.max_tokens, 0)
    engine = Engine(EngineConfig(model, args.pages, policy=policy), VirtualRunner())
    for p in range(args.prompts):
        prompt = [1 + (p * 7 + i) % 5000 for i in range(args.prompt_tokens)]
        ids = [f"p{p}-{j}" for j in range(args.n)]
        if grouped:
            others = [(rid, SamplingParams(seed=j)) for j, rid in enumerate(ids[1:], 1)]
            engine.add_request(ids[0], prompt, args.max_tokens, siblings=others)
        else:
            for rid in ids:
                engine.add_request(rid, prompt, args.max_tokens)
    clock, most, first, seen = 0.0, 0, [], set()
    while engine.has_work():
        outputs = engine.step()
        clock += (engine.last_result.duration_s or 0.0) if engine.last_result else 0.0
        most = max(most, engine.last_rows)
        for out in outputs:
            if out.new_token_ids and out.rid not in seen:
                seen.add(out.rid)
                first.append(clock)
    return clock, most, statistics.median(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pages", type=int, default=600)
    args = parser.parse_args()
    print(
        f"{args.prompts} prompts x n={args.n}, {args.prompt_tokens} prompt tokens, "
        f"{args.max_tokens} max_tokens, {args.pages} pages of 16 tokens"
    )
    print(f"{'policy':16} {'way':9} {'virtual s':>9} {'most rows':>9} {'TTFT p50':>9}")
    for policy in ("banker", "peak+backfill"):
        figures = {}
        for grouped in (False, True):
            way = "groups" if grouped else "separate"
            figures[way] = run(policy, args, grouped)
            clock, most, ttft = figures[way]
            print(f"{policy:16} {way:9} {clock:9.2f} {most:9d} {ttft:9.2f}")
        (c0, m0, t0), (c1, m1, t1) = figures["separate"], figures["groups"]
        print(f"{policy:16} {'ratio':9} {c0 / c1:8.2f}x {m1 / m0:8.2f}x {t0 / t1:8.2f}x")


if __name__ == "__main__":
    main()
