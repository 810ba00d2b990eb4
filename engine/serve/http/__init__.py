"""The OpenAI-compatible HTTP API in front of one engine."""
