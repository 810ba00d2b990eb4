"""The built-in model's folder, its tokenizer and chat template, sampling, and stop handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbank.engine.model.builtin import builtin_model_dir
from kvbank.engine.model.config import ConfigError, load_config, parse_config
from kvbank.engine.model.sampling import Sampler, probabilities
from kvbank.engine.model.textstream import TextStream
from kvbank.engine.model.tokenizer import ChatTemplateError, Tokenizer
from kvbank.engine.runner import SamplingParams


def test_builtin_folder_is_a_plain_hugging_face_checkpoint(builtin_model_dir: Path) -> None:
    names = sorted(p.name for p in builtin_model_dir.iterdir())
    assert names == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = load_config(builtin_model_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads) == (4, 256, 8)
    assert (config.num_kv_heads, config.vocab_size) == (2, 1024)
    assert builtin_model_dir.name.startswith("builtin-")


def test_builtin_folder_is_reused_not_rebuilt(builtin_model_dir: Path) -> None:
    stamp = (builtin_model_dir / "model.safetensors").stat().st_mtime_ns
    assert builtin_model_dir_again(builtin_model_dir) == builtin_model_dir
    assert (builtin_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def builtin_model_dir_again(folder: Path) -> Path:
    return builtin_model_dir(folder.parent)


def test_tokenizer_round_trips_text_and_renders_the_chat_template(
    builtin_model_dir: Path,
) -> None:
    tok = Tokenizer(builtin_model_dir)
    text = "The page cache holds 1234 tokens, héllo ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.token_id("<s>")
    assert tok.decode(ids) == text
    rendered = tok.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert rendered == "<s><|system|>\nBe brief.</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}]).count(tok.token_id("<s>")) == 1
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant"):
        tok.render_chat([{"role": "robot", "content": "x"}])


def test_the_chat_template_cannot_reach_python_internals(
    tmp_path: Path, builtin_model_dir: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((builtin_model_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        Tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_unsupported_configs_are_refused_with_the_field_named() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ConfigError, match="architectures\\[0\\]='GPT2LMHeadModel'"):
        parse_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        parse_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        parse_config({**base, "num_key_value_heads": 3})


def test_top_k_and_top_p_keep_exactly_the_expected_tokens() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    top_k = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top_k, torch.tensor([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]))
    # 0.5 + 0.2 = 0.7 < 0.8, so the third token (mass before it 0.7) is the last one kept.
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(top_p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.0)
    first = Sampler(torch.device("cpu"), seed=1)
    second = Sampler(torch.device("cpu"), seed=2)
    a = [first.sample(logits[:1], [("r", seeded)])[0] for _ in range(20)]
    b = []
    for _ in range(20):
        rows = [("x", other), ("r", seeded), ("y", other)]
        b.append(second.sample(logits[[1, 0, 2]], rows)[1])
    assert a == b
    assert len(set(a)) > 1  # it is sampling, not greedy


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert Sampler(torch.device("cpu")).sample(logits, [("a", SamplingParams())] * 2) == [1, 0]


class CharTokenizer:
    """One character per token id (id = code point), enough to pin the stream's arithmetic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _run(stream: TextStream, text: str) -> list[str]:
    return [stream.push(ord(c)) for c in text]


def test_stop_string_text_is_never_released() -> None:
    stream = TextStream(CharTokenizer(), stop=["END"])
    deltas = _run(stream, "abENxEND tail")
    assert deltas[:6] == ["a", "b", "", "", "ENx", ""]
    assert stream.stopped and stream.text == "abENx"
    assert stream.flush() == ""


def test_held_text_is_released_at_the_end_and_stop_tokens_end_output() -> None:
    stream = TextStream(CharTokenizer(), stop=["xyz"], stop_token_ids=[ord("!")])
    assert _run(stream, "abxy") == ["a", "b", "", ""]
    assert stream.flush() == "xy"
    stopped = TextStream(CharTokenizer(), stop_token_ids=[ord("!")])
    assert _run(stopped, "ok!more") == ["o", "k", "", "", "", "", ""]
    assert stopped.stopped and stopped.text == "ok"
