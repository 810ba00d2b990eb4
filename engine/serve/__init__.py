"""Serving: the `kvbank serve` command (`command`), the stack one rank serves with (`stack`) and
the OpenAI-compatible HTTP API (`http`)."""
