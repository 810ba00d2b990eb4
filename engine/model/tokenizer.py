"""The server's tokenizer: `tokenizer.json` through the `tokenizers` library, and the chat
template from `tokenizer_config.json` rendered in a sandboxed jinja2 environment (a template is
data from the model folder and must not reach Python objects)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

RELEASE_GIL_CHARS = 16_384  # longer texts are encoded with the GIL released


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; the model folder needs tokenizer.json")
        self._tokenizer = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _pick_template(config.get("chat_template"))
        self.eos_token_id = self.token_id(self.eos_token) if self.eos_token else None
        self._environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._environment.globals["raise_exception"] = _raise
        self._environment.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size())

    def to_json(self) -> str:
        """tokenizer.json as the tokenizers library writes it (for llguidance)."""
        return str(self._tokenizer.to_str())

    def token_id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < RELEASE_GIL_CHARS:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        # `encode` holds the GIL for the whole text (measured: 4.6 s for 4 MB, the server's
        # event loop frozen throughout); `encode_batch` releases it while it works.
        batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat_template in tokenizer_config.json; use /v1/completions"
            )
        try:
            template = self._environment.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes the BOS token itself, so the tokenizer must not add another.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
