"""`kvbank sidecar --pool` and `kvbank serve --pool` on a manifest whose architecture is
`fromConfig.path`, as the operator renders it for a rank (the config.json it judged beside the
manifest): the pool is sized by that config's layout, exactly as `kvbank check` sizes it, and a
layout kvbank's engine cannot decode is refused naming what to change."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sidecar_harness import ROOT, spawn_sidecar, stop_process

from kvbank.capacity import holdability
from kvbank.capacity.configured import resolve
from kvbank.engine.serve.command import add_arguments, options_from_args
from kvbank.modelpool import parse_modelpool
from kvbank.sidecar.client import SidecarClient

pytestmark = pytest.mark.timeout(60)
CONFIGS = ROOT / "tests" / "data" / "configs"


def manifest(folder: Path, config: str, **spec: Any) -> Path:
    """A memory-fraction pool of `config` (a file in tests/data/configs) beside its copy."""
    shutil.copy(CONFIGS / config, folder / "model-config.json")
    doc = {
        "apiVersion": "kvbank.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": "m", "namespace": "team-a"},
        "spec": {
            "model": {
                "name": "m",
                "architecture": {"fromConfig": {"path": "model-config.json"}},
            },
            "gpu": {"memoryGiB": 80, "memoryUtilization": 0.9},
            "kv": {"pageSize": 16, "memoryFraction": 0.9},
            "limits": {"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
            **spec,
        },
    }
    path = folder / "modelpool.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def judged_pages(path: Path) -> int:
    pool = parse_modelpool(yaml.safe_load(path.read_text()))
    return holdability(pool, resolve(pool, path.parent)).pages


def test_the_sidecar_serves_the_pool_the_layout_sizes(tmp_path: Path) -> None:
    path = manifest(tmp_path, "gpt-oss-20b.json")
    pages = judged_pages(path)
    assert pages > 20000  # the placeholder architecture would give another count
    proc, port, _ = spawn_sidecar("--pool", str(path), "--metrics-port", "-1")
    try:
        with SidecarClient(f"127.0.0.1:{port}") as client:
            assert client.status().usable_pages == pages - 1  # the sink page
    finally:
        stop_process(proc)


def test_serve_takes_a_full_attention_layout_as_its_one_label(tmp_path: Path) -> None:
    path = manifest(tmp_path, "llama-3.1-8b.json")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = options_from_args(parser.parse_args(["--pool", str(path)]))
    assert (options.pages, options.kv_label) == (judged_pages(path), "full")


def serve_refusal(path: Path) -> str:
    """What `kvbank serve --pool path` says as it refuses the pool."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError) as refused:
        options_from_args(parser.parse_args(["--pool", str(path)]))
    return str(refused.value)


def test_serve_refuses_a_layout_its_decoder_cannot_write(tmp_path: Path) -> None:
    path = manifest(tmp_path, "gpt-oss-20b.json")
    assert serve_refusal(path) == (
        f"--pool {path}: spec.model.architecture.fromConfig lays this model out in 2 KV "
        "group(s): sliding (12 layers, window 128: at most 265 pages), full (12 layers, every "
        "position); this engine's decoder writes one group of full attention. Serve it with "
        "vLLM (spec.engine.kind: vllm)"
    )


def test_serve_refuses_the_prefix_order_which_only_vllms_scheduler_class_runs(
    tmp_path: Path,
) -> None:
    path = manifest(tmp_path, "llama-3.1-8b.json", admission={"order": "prefix"})
    assert serve_refusal(path) == (
        f"--pool {path}: spec.admission.order is prefix, which kvbank's scheduler class inside "
        "vLLM carries out; this engine asks in arrival order; drop it, or serve the pool with "
        "vLLM (spec.engine.kind: vllm)"
    )


def test_a_config_missing_beside_the_manifest_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    path = manifest(tmp_path, "gpt-oss-20b.json")
    (tmp_path / "model-config.json").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "sidecar", "--pool", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    err = done.stderr
    assert done.returncode == 2, err
    assert "Traceback" not in err
    assert "spec.model.architecture.fromConfig config.json: cannot read" in err
