"""Constrained decoding through llguidance: a JSON schema becomes a grammar over the served
tokenizer's tokens, and each step a request's matcher masks the tokens the grammar forbids.

A grammar is compiled (and checked) when the request arrives, so a bad schema is a 400 and never
reaches the engine. Its matcher lives in the sampler, created at the request's first sample and
fed every token it samples; once the grammar is complete only the end-of-text token is allowed,
so the request stops there. The mask is computed on the CPU (llguidance releases the GIL while it
works) and applied to the row's logits after logit_bias and the penalties.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer

from kvbank.engine.model.sampling import SamplingError

# Not llguidance.torch: importing it brings in torch.compile's machinery (measured 4.9 s), which
# in a tensor-parallel group is longer than a follower waits for rank 0's first word.

# Compact JSON: a model that may put whitespace anywhere fills its budget with it.
JSON_OPTIONS: Any = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message is llguidance's."""


class GrammarCompiler:
    """The served tokenizer as llguidance sees it, shared by the HTTP layer (to compile) and
    the sampler (to match)."""

    def __init__(self, tokenizer_json: str, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.tokenizer = LLTokenizer(tokenizer_json, eos_token=eos_token_id)

    def json_schema(self, schema: dict[str, Any] | None) -> str:
        """A grammar for JSON matching `schema` (None: any JSON object). Raises GrammarError."""
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                json.dumps(schema if schema is not None else ANY_OBJECT), JSON_OPTIONS
            )
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer) or self._probe(grammar)
        if problem:
            raise GrammarError(problem)
        return grammar

    def _probe(self, grammar: str) -> str:
        """Why a matcher over `grammar` gives up before its first free choice ("": it does
        not). A grammar can validate and still fail once matched: a schema that only refers
        to itself leaves no token to start with, and `^a{1000000}$` passes the lexer's limits
        only once its forced prefix is fed in. Feeding the tokens the grammar forces costs a
        fraction of a second even for those, and finds them here rather than mid-response."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()
        forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
        if forced:
            matcher.consume_tokens(forced)
        if not matcher.is_error():
            return ""
        return (
            f"matching it gives up before the response's first free token "
            f"({first_line(matcher.get_error())}): a schema that only refers to itself "
            f"describes no value, and repeat counts in the millions are past the grammar "
            f"engine's limits"
        )

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(self, grammar)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        self.compiler = compiler
        self.state = LLMatcher(compiler.tokenizer, grammar)

    def mask(self, logits: torch.Tensor) -> None:
        """logits: [vocab], in place: the tokens the grammar forbids next get -inf. Raises
        SamplingError when the matcher gave up: llguidance reports a grammar past its limits
        only as an error state, and that state is also "stopped", which must not read as a
        complete output."""
        self._check()
        if self.state.is_stopped():  # complete: only the end of text is left
            eos = self.compiler.eos_token_id
            keep = logits[eos].clone()
            logits.fill_(float("-inf"))
            logits[eos] = keep
            return
        # One bit per token, least significant first; computed with the GIL released.
        packed = torch.frombuffer(bytearray(self.state.compute_bitmask()), dtype=torch.uint8)
        bits = torch.arange(8, dtype=torch.uint8)
        allowed = ((packed.unsqueeze(1) >> bits) & 1).flatten().bool().to(logits.device)
        size = min(allowed.shape[0], logits.shape[0])
        logits[:size].masked_fill_(~allowed[:size], float("-inf"))
        logits[size:] = float("-inf")  # ids past the tokenizer's vocabulary are never text

    def consume(self, token: int) -> None:
        if not self.state.consume_token(token):
            self._check()

    def _check(self) -> None:
        if self.state.is_error():
            raise SamplingError(
                f"the grammar engine gave up on the response_format schema partway: "
                f"{first_line(self.state.get_error())}; simplify the schema (smaller repeat "
                f"counts, no schema that only refers to itself)",
                "response_format",
            )


def first_line(message: str, limit: int = 300) -> str:
    """llguidance's error without the parser-state dump it appends, at a bounded length."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "..."
