"""`vllm serve` with kvbank's scheduler class on models of several KV cache groups, through the
official `openai` client, one kvbank server per model, both started together:

- sliding: the built-in random-weight Llama with every other layer a sliding window (Hugging
  Face's `layer_types`, which vLLM's Llama reads), so vLLM's hybrid allocator makes a
  full-attention group and a sliding-window group;
- hybrid: a tiny random-weight Granite 4 hybrid (granitemoehybrid: Mamba-2 layers beside
  attention, no experts) written with transformers, served without prefix caching (kvbank
  counts a Mamba state in vLLM's mode "none"), so a full-attention group and a Mamba group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_server import MODEL_NAME, VllmServer, start_all

pytestmark = pytest.mark.timeout(600)

BLOCKS = 24  # of 128 tokens; 23 hold requests (the longest takes 15 + 5)
MAX_MODEL_LEN = 1920
WINDOW = 256
# A small step budget, so a window's worst case (its window and one step) is below every
# position: 256 - 1 + 256 tokens, 5 blocks, against 15 for the longest request.
BATCHED = 256


@pytest.fixture(scope="module")
def sliding_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model's weights and tokenizer with a config whose layers alternate
    sliding window and full attention."""
    folder = tmp_path_factory.mktemp("sliding-llama")
    for name in os.listdir(model_dir):
        if name != "config.json":
            (folder / name).symlink_to(model_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    config["sliding_window"] = WINDOW
    config["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def hybrid_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mamba-2, attention, Mamba-2, attention: random weights from a fixed seed, the built-in
    model's tokenizer."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    folder = tmp_path_factory.mktemp("granite-hybrid")
    base = json.loads((model_dir / "config.json").read_text())
    config = GraniteMoeHybridConfig(
        vocab_size=base["vocab_size"], hidden_size=128, intermediate_size=256,
        shared_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
        max_position_embeddings=4096, bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"], pad_token_id=base["eos_token_id"],
        tie_word_embeddings=False, position_embedding_type="rope",
    )  # fmt: skip
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(config).to(torch.float32).save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written.pop("time_step_limit", None)  # (0, inf): JSON has no infinity; vLLM's default
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(model_dir / name)
    return folder


@pytest.fixture(scope="module")
def servers(
    sliding_model: Path, hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-serve-groups")
    common = {
        "kvbank": True, "blocks": BLOCKS, "max_model_len": MAX_MODEL_LEN,
        "env": {"KVBANK_POLICY": "peak+backfill"},
    }  # fmt: skip
    batched = ["--max-num-batched-tokens", str(BATCHED), "--max-num-seqs", "64"]
    started = start_all(
        [
            VllmServer(sliding_model, logs / "sliding.log", extra_args=batched, **common),
            VllmServer(
                hybrid_model,
                logs / "hybrid.log",
                extra_args=["--no-enable-prefix-caching"],
                **common,
            ),
        ]
    )
    yield dict(zip(("sliding", "hybrid"), started, strict=True))
    for server in started:
        server.stop()


@pytest.fixture(scope="module", params=["sliding", "hybrid"])
def server(request: pytest.FixtureRequest, servers: dict[str, VllmServer]) -> VllmServer:
    return servers[request.param]


def test_the_plug_in_took_the_two_group_layout(server: VllmServer) -> None:
    """The class refuses at start-up a layout it cannot count; this one it serves."""
    log = server.log_text()
    assert "Using custom scheduler class kvbank.vllm.KvbankScheduler" in log
    assert "kvbank cannot count" not in log


def test_completions_chat_and_streaming_past_the_window(server: VllmServer) -> None:
    client = server.client
    prompt = " ".join(["the page cache holds"] * 80)  # past the window: blocks are freed
    done = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens == 200
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "admission"}], max_tokens=8
    )
    assert chat.choices[0].message.content is not None
    chunks = client.completions.create(
        model=MODEL_NAME, prompt="decode the batch", max_tokens=8, stream=True, temperature=0
    )
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text) >= 1


def test_under_kv_pressure_kvbank_never_preempts(server: VllmServer) -> None:
    """Twelve long requests into 23 blocks: each needs 4 blocks of full attention and 4 of
    window (or 1 of state), so two or five run at once; they queue in kvbank's FIFO, vLLM
    never preempts."""
    client = server.client

    def one(i: int) -> int:
        done = client.completions.create(
            model=MODEL_NAME, prompt=f"request {i} " + "ledger pool " * 60, max_tokens=300,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert done.usage is not None
        return done.usage.completion_tokens

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == [300] * 12
    assert server.metric("vllm:num_preemptions_total") == 0
    assert "kvbank bug" not in server.log_text()
