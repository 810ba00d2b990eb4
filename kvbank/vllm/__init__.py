"""kvbank's admission inside vLLM: vLLM's own v1 scheduler and KV cache manager, with waiting
requests admitted by kvbank's ledger, so a running request never needs preempting.

    KVBANK_POLICY=peak+backfill vllm serve MODEL --scheduler-cls kvbank.vllm.KvbankScheduler

Configured by environment variables (kvbank.vllm.settings). The scheduler class is loaded
lazily, so the settings and layout checks import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvbankScheduler"]


def __getattr__(name: str) -> Any:
    if name == "KvbankScheduler":
        from kvbank.vllm.scheduler import KvbankScheduler

        return KvbankScheduler
    raise AttributeError(f"module 'kvbank.vllm' has no attribute {name!r}")
