"""The built-in model: a small random-weight Llama and a byte-level BPE tokenizer, built with no
download into `${XDG_CACHE_HOME:-~/.cache}/kvbank/builtin-<hash>` and then loaded through the
same loader and tokenizer a real checkpoint uses.

Everything is derived from fixed seeds, so every machine builds the same folder name for the same
spec. It is built once into a temporary folder and renamed into place, so two processes starting
together never see half a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPEC = {
    "format": 1,
    "seed": 20240601,
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
BOS, EOS = "<s>", "</s>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three page cache token request "
    "admission ledger pool model serve engine batch decode prefill prompt output reserve"
)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvbank"


def builtin_model_dir(root: Path | None = None) -> Path:
    """The built-in model's folder, building it first if this machine has not yet."""
    digest = hashlib.sha256(
        json.dumps([SPEC, CHAT_TEMPLATE, SPECIAL_TOKENS], sort_keys=True).encode()
    ).hexdigest()[:12]
    root = root or cache_root()
    target = root / f"builtin-{digest}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        _build(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its folder is the same
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words_pool = _WORDS_TEXT.split()
    lines = []
    for _ in range(2000):
        words = rng.choices(words_pool, k=rng.randint(4, 14))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        lines.append(line + (f" {rng.randint(0, 9999)}" if rng.random() < 0.2 else ""))
    return lines


def _build_tokenizer(folder: Path, vocab_size: int, seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": SPEC["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer


def _build(folder: Path) -> None:
    seed = int(SPEC["seed"])
    tokenizer = _build_tokenizer(folder, int(SPEC["vocab_size"]), seed)
    vocab = tokenizer.get_vocab_size()
    hidden, inner = int(SPEC["hidden_size"]), int(SPEC["intermediate_size"])
    heads, kv_heads = int(SPEC["num_attention_heads"]), int(SPEC["num_key_value_heads"])
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": SPEC["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": SPEC["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # Scaled so activations stay O(1) and logits spread over a few units: greedy choices are then
    # far apart compared with float32 rounding, so batch size or chunking cannot flip them.
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(int(SPEC["num_hidden_layers"])):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = normal(hidden, hidden, std=hidden**-0.5)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.2)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=0.1)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, hidden, std=0.5 * hidden**-0.5)
        weights[p + "mlp.gate_proj.weight"] = normal(inner, hidden, std=hidden**-0.5)
        weights[p + "mlp.up_proj.weight"] = normal(inner, hidden, std=hidden**-0.5)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inner, std=0.5 * inner**-0.5)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden, std=3.0 * hidden**-0.5)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
