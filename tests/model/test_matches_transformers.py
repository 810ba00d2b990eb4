"""The paged model reproduces transformers' logits on the same random weights (float32).

Tolerance: max |difference| <= 2e-4 on logits of order 1 — what float32 reordering of the same
sums gives; a wrong weight mapping, rope variant or norm shows up as differences near 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbank.engine.model.loader import load_model
from kvbank.engine.model.runner import TorchRunner
from tests.model.reference import batch, prefill_row, save_reference

TOLERANCE = 2e-4
PAGE_SIZE = 4

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_theta": 500000.0,
            "max_position_embeddings": 1024,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_logits_match_transformers(case: str, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    reference = save_reference(kind, tmp_path, shard=case == "llama", **overrides)
    model = load_model(tmp_path, torch.device("cpu"))
    runner = TorchRunner(model, num_pages=64, page_size=PAGE_SIZE, eos_token_id=0)

    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 300, 1, 64]
    pages = list(range(10, 40))[::-1]  # scattered, descending page ids
    generated = list(prompt)
    ours = runner.forward(batch(prefill_row("a", prompt, pages)))["a"]
    with torch.no_grad():
        for step in range(24):
            theirs = reference(torch.tensor([generated])).logits[0, -1]
            diff = (ours - theirs).abs().max().item()
            assert diff <= TOLERANCE, f"{case}: step {step} differs by {diff}"
            token = int(theirs.argmax())
            generated.append(token)
            row = prefill_row("a", [token], pages, start=len(generated) - 1)
            ours = runner.forward(batch(row, step=step + 1))["a"]


def test_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    save_reference("llama", tmp_path, shard=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
