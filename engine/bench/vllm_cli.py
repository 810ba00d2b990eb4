"""`kvbank bench --engine vllm`: the scenario through vLLM's own scheduler (policies `vllm`,
`vllm+banker`, `vllm+peak+backfill`, `vllm+peak+backfill+prefix`).

vLLM lives in its own virtual environment (its torch pin differs from the engine's). When this
interpreter cannot import vllm, the command runs itself again under the interpreter that can:
`KVBANK_VLLM_PYTHON` if set, else the checkout's `.venv-vllm/bin/python` (`make vllm-venv`
creates it), with this source tree first on its path. Checks that need no vLLM (the policy
names, whether vLLM can express the scenario) run first, here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from kvbank.engine.bench.scenario import Scenario

# kvbank.engine.bench.vllm_simulate; +prefix: KVBANK_ORDER=prefix
POLICIES = ("vllm", "vllm+banker", "vllm+peak+backfill", "vllm+peak+backfill+prefix")
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout: engine/bench/ -> root


def scenario_refusal(scenario: Scenario) -> str | None:
    """Why vLLM cannot run this scenario as written, or None. Each KV label is one of vLLM's KV
    cache groups (kvbank.engine.bench.vllm_engine.kv_cache_groups): attention, written once
    per prompt and output token (full, or a `sliding_window` or `attention_chunk` label), or a
    Mamba state, a label of fixed tokens only, 1 + speculative_tokens pages (vLLM's mode
    "none": the run has no prefix caching). vLLM writes every group for every request and has
    no per-request fixed tokens."""
    model = scenario.model
    state_tokens = (1 + model.speculative_tokens) * model.page_size
    attention = 0
    for label, slot in model.kv_slots.items():
        if (slot.prompt, slot.output, slot.fixed) == (1, 1, 0):
            attention += 1
            continue
        if (slot.prompt, slot.output) == (0, 0) and slot.fixed and label not in scenario.kv_windows:
            if slot.fixed == state_tokens:
                continue
            return (
                f"label {label!r} is a state of {slot.fixed} fixed tokens; vLLM's Mamba state "
                f"holds 1 + speculative_tokens pages (fixed: {state_tokens}), so this scenario "
                "runs on --engine kvbank only"
            )
        return (
            f"label {label!r} writes {slot.prompt} per prompt token, {slot.output} per output "
            f"token and {slot.fixed} fixed tokens; vLLM's KV cache groups write one slot per "
            "token (attention) or hold a fixed state, so this scenario runs on --engine "
            "kvbank only"
        )
    if not attention:
        return "the model has no attention label; vLLM's bench needs one to size its blocks"
    for cls in scenario.workload.classes:
        if any(cls.fixed_label_tokens.values() if cls.fixed_label_tokens else ()):
            return (
                f"class {cls.name!r} sets fixed_label_tokens; vLLM has no fixed tokens per "
                "label, so this scenario runs on --engine kvbank only"
            )
        if cls.only_labels is not None and cls.only_labels != set(model.kv_slots):
            return (
                f"class {cls.name!r} sets only_labels; vLLM writes every KV cache group for "
                "every request, so this scenario runs on --engine kvbank only"
            )
    return None


def _policies(value: str) -> list[str] | str:
    names = list(POLICIES) if value == "all" else [p.strip() for p in value.split(",")]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        return (
            f"unknown --policy {', '.join(map(repr, unknown))} for --engine vllm; choose 'all' "
            f"or one or more of {', '.join(POLICIES)} (the kvbank policies run on --engine "
            "kvbank)"
        )
    return names


def vllm_python() -> Path | None:
    configured = os.environ.get("KVBANK_VLLM_PYTHON")
    if configured:
        return Path(configured)
    candidate = SOURCE_ROOT / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def run_vllm(args: argparse.Namespace, scenario: Scenario) -> int:
    policies = _policies(args.policy)
    if isinstance(policies, str):
        print(f"kvbank bench: {policies}", file=sys.stderr)
        return 2
    if getattr(args, "backfill", False):
        print(
            "kvbank bench: --backfill applies to --engine kvbank; on --engine vllm name "
            "vllm+peak+backfill in --policy",
            file=sys.stderr,
        )
        return 2
    why = scenario_refusal(scenario)
    if why is not None:
        print(f"kvbank bench: --engine vllm cannot run {scenario.name}: {why}", file=sys.stderr)
        return 2
    from kvbank.engine.bench.plot import check_target, plot

    if args.plot and (problem := check_target(Path(args.plot))) is not None:
        print(f"kvbank bench: {problem}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        return _reexec(args)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvbank.engine.bench.cli import render_table
    from kvbank.engine.bench.vllm_simulate import run_vllm_policy

    results = [
        run_vllm_policy(scenario, name, args.debug, True, getattr(args, "sidecar", None))
        for name in policies
    ]
    if args.json:
        print(json.dumps([r.metrics for r in results], indent=2))
    else:
        print(render_table(scenario, results))
    if args.plot:
        plot(scenario, results, Path(args.plot))
        print(f"kvbank bench: plot written to {Path(args.plot).resolve()}", file=sys.stderr)
    return 1 if any(r.metrics["invariant_breaches"] for r in results) else 0


def _reexec(args: argparse.Namespace) -> int:
    python = vllm_python()
    if python is None or not python.exists():
        print(
            "kvbank bench: --engine vllm needs the vllm package (0.33.0), which this Python "
            f"({sys.executable}) cannot import; run `make vllm-venv` in the checkout (it "
            "creates .venv-vllm) or set KVBANK_VLLM_PYTHON to a Python that has vllm"
            + (f" ({python} does not exist)" if python is not None else ""),
            file=sys.stderr,
        )
        return 2
    argv = ["bench", "--engine", "vllm", "--scenario", str(args.scenario)]
    argv += ["--policy", args.policy]
    argv += ["--json"] if args.json else []
    argv += ["--debug"] if args.debug else []
    argv += ["--plot", str(args.plot)] if args.plot else []
    argv += ["--sidecar", args.sidecar] if getattr(args, "sidecar", None) else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return subprocess.run([str(python), "-m", "kvbank.cli", *argv], env=env, check=False).returncode
