"""`kvbank plan` and `kvbank check` on pools read from a model's config.json, as a user runs
them: the console script, real files, exit codes, one-line errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbank.capacity import CapacityModel, holdability
from kvbank.modelpool import parse_modelpool

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "configs"


def kvbank(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvbank", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "kvbank.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def plan_json(*args: str) -> dict[str, Any]:
    out = kvbank("plan", "--json", *args)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def test_llama_70b_on_eight_80gib_gpus() -> None:
    out = kvbank(
        "plan",
        "--config",
        str(CONFIGS / "llama-3.1-70b.json"),
        "--gpu-memory",
        "80GiB",
        "--tp",
        "8",
        "--max-seq-len",
        "131072",
        "--min-concurrency",
        "32",
    )
    assert out.returncode == 1  # 11 at 128k is below 32: the plan says so
    assert "per rank 91051 pages of 16 tokens (655360 bytes" in out.stdout
    assert "the pool holds 11 at once" in out.stdout
    assert "minConcurrency 32: largest maxSeqLen 45520" in out.stdout
    figures = plan_json(
        "--config",
        str(CONFIGS / "llama-3.1-70b.json"),
        "--gpu-memory",
        "80GiB",
        "--tp",
        "8",
        "--max-seq-len",
        "131072",
        "--min-concurrency",
        "32",
    )
    assert figures["worst_request_pages"] == 8192
    assert figures["largest_max_seq_len"] == 45520
    assert 32 * 45520 // 16 <= figures["usable_pages"] < 32 * (45520 // 16 + 1)
    mem = figures["memory"]
    assert mem["weights_bytes"] + mem["kv_bytes"] + mem["left_bytes"] == mem["budget_bytes"]


def test_gpt_oss_at_8k_counts_the_window_and_the_steps_in_flight() -> None:
    args = (
        "--config",
        str(CONFIGS / "gpt-oss-20b.json"),
        "--gpu-memory",
        "80GiB",
        "--max-seq-len",
        "8192",
    )
    default = plan_json(*args)
    small_steps = plan_json(*args, "--max-num-batched-tokens", "2048")
    # two of vLLM's default 8192-token steps in flight let the window hold 16511 tokens: all
    # of an 8k request; two 2048-token steps, 4223 tokens
    assert [g["worst_request_pages"] for g in default["groups"]] == [512, 512]
    assert [g["worst_request_pages"] for g in small_steps["groups"]] == [265, 512]
    assert small_steps["worst_concurrency"] > default["worst_concurrency"]


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        ("gpt-oss-20b.json", ["--max-num-batched-tokens", "2048"]),
        ("gemma-3-27b.json", ["--tp", "2"]),
        ("qwen3-next-80b-a3b.json", ["--tp", "4", "--kv-dtype", "fp8"]),
        ("jamba-v0.1.json", ["--tp", "2", "--speculative-tokens", "1"]),
        ("llama-4-scout.json", ["--tp", "8"]),
        ("deepseek-v3.json", ["--tp", "8", "--gpu-memory", "141GiB"]),
    ],
)
def test_the_written_pool_passes_check_with_the_same_figures(
    tmp_path: Path, config: str, extra: list[str]
) -> None:
    out_file = tmp_path / "pool.yaml"
    memory = [] if "--gpu-memory" in extra else ["--gpu-memory", "80GiB"]
    args = [
        "--config",
        str(CONFIGS / config),
        *memory,
        "--max-seq-len",
        "32768",
        "--min-concurrency",
        "4",
        *extra,
    ]
    figures = plan_json(*args, "--write-pool", str(out_file))
    doc = yaml.safe_load(out_file.read_text())
    parse_modelpool(doc)  # the same reader the operator uses
    out = kvbank("check", str(out_file))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"worst-case request {figures['worst_request_pages']} pages" in out.stdout
    assert f"holds {figures['worst_concurrency']} worst-case requests" in out.stdout
    for group in figures["groups"]:
        assert f"group {group['label']}: " in out.stdout


def test_a_preset_plan_round_trips_too(tmp_path: Path) -> None:
    out_file = tmp_path / "pool.yaml"
    figures = plan_json(
        "--preset",
        "llama-3.1-8b",
        "--gpu-memory",
        "24GiB",
        "--max-seq-len",
        "8192",
        "--write-pool",
        str(out_file),
    )
    out = kvbank("check", str(out_file))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"holds {figures['worst_concurrency']} worst-case requests" in out.stdout


def test_check_reads_from_config_beside_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    shutil.copy(CONFIGS / "gpt-oss-20b.json", tmp_path / "model" / "config.json")
    manifest = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": "oss"},
        "spec": {
            "model": {
                "name": "gpt-oss-20b",
                "architecture": {"fromConfig": {"path": "model/config.json"}},
            },
            "gpu": {"memoryGiB": 80},
            "kv": {"pageSize": 16, "memoryFraction": 1.0},
            "limits": {"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
        },
    }
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(manifest))
    out = kvbank("check", str(path), cwd=Path("/"))
    assert out.returncode == 0, out.stderr
    assert "worst-case request 777 pages" in out.stdout
    assert "group sliding: 12 layers, window 128: at most 265 pages" in out.stdout


def write_pool(tmp_path: Path, architecture: dict[str, Any], **spec: Any) -> Path:
    manifest = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": "p"},
        "spec": {
            "model": {"name": "m", "architecture": architecture},
            "gpu": {"memoryGiB": 80},
            "kv": {"pageSize": 16, "pages": 1000},
            "limits": {"maxSeqLen": 8192, "maxTokens": 2048},
            **spec,
        },
    }
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_a_bad_config_is_one_line_naming_its_field(tmp_path: Path) -> None:
    bad = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    bad["model_type"] = "falcon9"
    (tmp_path / "config.json").write_text(json.dumps(bad))
    out = kvbank("check", str(write_pool(tmp_path, {"fromConfig": {"path": "config.json"}})))
    assert out.returncode == 2
    assert "spec.model.architecture.fromConfig model_type: 'falcon9' is not a family" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_missing_config_and_a_tp_it_cannot_split(tmp_path: Path) -> None:
    out = kvbank("check", str(write_pool(tmp_path, {"fromConfig": {"path": "nowhere.json"}})))
    assert out.returncode == 2 and "cannot read" in out.stderr
    shutil.copy(CONFIGS / "llama-3.1-8b.json", tmp_path / "config.json")
    path = write_pool(tmp_path, {"fromConfig": {"path": "config.json"}}, tensorParallel=3)
    out = kvbank("check", str(path))
    assert out.returncode == 2
    assert "spec.tensorParallel: 3 does not divide the model's 32 attention heads" in out.stderr


def test_a_hybrid_pool_whose_page_is_too_small_for_its_state_says_the_size(
    tmp_path: Path,
) -> None:
    shutil.copy(CONFIGS / "jamba-v0.1.json", tmp_path / "config.json")
    out = kvbank("check", str(write_pool(tmp_path, {"fromConfig": {"path": "config.json"}})))
    assert out.returncode == 1
    assert "Set kv.pageSize to 80" in out.stdout


@pytest.mark.parametrize(
    ("architecture", "spec", "words"),
    [
        ({"fromConfig": {"path": "c.json"}, "layers": 3}, {}, "drop layers beside it"),
        ({"fromConfig": {}}, {}, "give exactly one of path"),
        ({"fromConfig": {"path": "c.json", "kvDtype": "int3"}}, {}, "kvDtype: must be one of"),
        ({"fromConfig": {"path": "c.json"}}, {"kvSlots": {"main": {"prompt": 1}}}, "drop kvSlots"),
        ({"fromConfig": "c.json"}, {}, "must be a mapping"),
    ],
)
def test_from_config_fields_are_checked(
    tmp_path: Path, architecture: dict[str, Any], spec: dict[str, Any], words: str
) -> None:
    out = kvbank("check", str(write_pool(tmp_path, architecture, **spec)))
    assert out.returncode == 2
    assert words in out.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tp", "0"], "--tp must be from 1 to 64, got 0"),
        (["--gpu-memory", "lots"], "is not a size"),
        (["--tp", "3"], "--tp: 3 does not divide"),
        (["--gpu-memory", "8GiB"], "leave no KV pages"),
    ],
)
def test_plan_refuses_bad_flags_in_one_line(flags: list[str], words: str) -> None:
    args = ["plan", "--config", str(CONFIGS / "llama-3.1-70b.json"), "--gpu-memory", "80GiB"]
    out = kvbank(*args, *flags)
    assert out.returncode != 0
    assert words in out.stderr
    assert "Traceback" not in out.stderr


def test_a_reader_that_loads_no_files_refuses_a_configured_pool(tmp_path: Path) -> None:
    # the webhook and the sidecar call holdability without the layout: they must not judge
    # the placeholders, nor count a pool without kvSlots as needing no pages
    doc = yaml.safe_load(write_pool(tmp_path, {"fromConfig": {"path": "c.json"}}).read_text())
    pool = parse_modelpool(doc)
    held = holdability(pool)
    assert not held.ok and "fromConfig is not resolved here" in held.violations[0]
    with pytest.raises(ValueError, match="fromConfig"):
        CapacityModel.from_pool(pool)
