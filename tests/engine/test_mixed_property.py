"""Random mixes of the shape that once broke the peak-fit ledger: strict image requests writing
fixed tokens into several labels, beside best-effort chat sharing a system prompt (and strict
chat), with host tiers, long enough to fill and refill the pool. Debug mode checks the ledger
and the second check (engine/safety.py) after every step; on top, every request the engine
took finishes, no strict request is preempted and none stalls (tests/mixed_workload.py).

Two generators: hypothesis over small pools (exact, shrinkable), and seeded bench scenarios of
hundreds of requests run on the virtual clock through `kvbank bench`'s own runner."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from mixed_workload import BREACH, IMAGE_LABELS, POOL, SPECS, Spec, mixed_config, run_mixed

from kvbank.engine.bench.scenario import load_scenario
from kvbank.engine.bench.simulate import run_policy
from kvbank.engine.request import Status
from kvbank.mode import LEDGER_MODE_NAMES


@pytest.mark.parametrize("policy", LEDGER_MODE_NAMES)
@settings(max_examples=25, deadline=None)
@example(pages=19, host_pages=0, budget=8, speculative=1, max_preemptions=1, specs=BREACH)
@given(specs=SPECS, **POOL)
def test_images_beside_best_effort_chat_keep_every_strict_promise(
    policy: str, specs: list[Spec], **pool: int
) -> None:
    engine = run_mixed(mixed_config(policy, **pool), specs)
    assert all(r.status is Status.FINISHED for r in engine.sched.running.values())


def mixed_scenario(seed: int, requests: int) -> dict[str, object]:
    """A bench scenario of the breach's shape, drawn from `seed`."""
    r = random.Random(seed)
    prefix = r.choice([64, 128, 256])
    fixed = {
        "main": r.choice([32, 64, 128]),
        "cfg_text": r.choice([16, 32, 64]),
        "cfg_img": r.choice([32, 64, 128]),
    }
    return {
        "name": f"mixed-{seed}",
        "about": "strict images beside best-effort chat sharing a system prompt",
        "pool": {
            "pages": r.choice([96, 128, 160, 200]),
            "page_size": 16,
            "host_pages": r.choice([0, 256, 512]),
        },
        "model": {
            "kv_slots": {name: {"prompt": 1, "output": 1} for name in IMAGE_LABELS},
            "max_seq_len": 2048,
            "max_tokens_default": 256,
            "speculative_tokens": r.choice([0, 1]),
            "tp": 1,
        },
        "cost_model": {
            "step_base_ms": 8,
            "prefill_ms_per_token": 0.02,
            "decode_ms_per_row": 0.05,
            "attn_ms_per_page": 0.002,
            "host_ms_per_page": 0.08,
        },
        "time_limit_s": 3600,
        "workload": {
            "rate_per_s": r.choice([4, 8, 16]),
            "requests": requests,
            "seed": seed,
            "classes": [
                {
                    "name": "image",
                    "weight": 1,
                    "service_class": "strict",
                    "prompt_tokens": {"min": 10, "max": 60},
                    "fixed_label_tokens": fixed,
                    "max_tokens": r.choice([64, 128]),
                    "output_tokens": {"min": 16, "max": 128},
                },
                {
                    "name": "chat",
                    "weight": r.choice([2, 3]),
                    "service_class": "best-effort",
                    "shared_prefix": "system",
                    "shared_prefix_tokens": prefix,
                    "prompt_tokens": {"min": prefix + 4, "max": prefix + 80},
                    "only_labels": ["main"],
                    "max_tokens": r.choice([64, 128]),
                    "output_tokens": {"min": 4, "max": 128},
                },
            ],
        },
    }


@pytest.mark.parametrize("seed", [86, 87, 91, 109, 125, 100])
def test_seeded_mixed_scenarios_finish_under_peak_fit(seed: int, tmp_path: Path) -> None:
    """Of seeds 80 to 129, these five broke `peak` or `peak+backfill` (or both) before exclusive
    pages were counted by strict holders, and 100 held; 300 requests each, the second check
    after every step."""
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(mixed_scenario(seed, 300)))
    scenario = load_scenario(path)
    for policy in ("peak", "peak+backfill"):
        metrics = run_policy(scenario, policy, check=True).metrics
        assert (metrics["completed"], metrics["hung"], metrics["invariant_breaches"]) == (
            300,
            0,
            0,
        ), (policy, metrics["stopped"])
