"""kvbank: KV-cache admission control for LLM serving.

An admitted request never runs out of KV-cache pages: every part admits by one capacity function
(`kvbank.capacity`) and one reservation ledger (`kvbank.ledger`).
"""

__version__ = "0.1.0"
