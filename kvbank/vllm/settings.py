"""The scheduler class's settings, read once from the environment (the names are fixed):

- `KVBANK_POLICY`: the ledger's test, one of banker, banker+backfill, peak, peak+backfill
  (default peak+backfill).
- `KVBANK_SIDECAR`: host:port, or `unix:///PATH`, of a `kvbank sidecar` that keeps the ledger;
  unset, the ledger is embedded in vLLM's engine process. A served engine never waits for the
  sidecar's answer: the decisions of one schedule are applied at a later one.
- `KVBANK_SIDECAR_TOKEN_FILE`: the sidecar's shared token (the file `kvbank sidecar
  --token-file` reads).
- `KVBANK_SIDECAR_CA_FILE`: a CA bundle; with it the channel to the sidecar is TLS.
- `KVBANK_DEFAULT_CLASS`: the class of a request that asks for none (kvbank.vllm.classes),
  strict or best-effort (default strict).
- `KVBANK_MAX_PREEMPTIONS`: a best-effort request preempted this many times runs strict from then
  on (default `ClassPolicy`'s, 2).
- `KVBANK_ORDER`: the order strict requests meet the ledger in (kvbank.vllm.order), fifo or
  prefix (default fifo), with the embedded ledger or a sidecar's.
- `KVBANK_MAX_DEFER_STEPS`: under prefix order, admission passes (one a schedule while requests
  wait) a request may be moved behind later ones before it keeps its place (default 2048; 0 never
  moves one).
- `KVBANK_BEST_EFFORT_PRIORITY`: under `vllm serve --scheduling-policy priority`, a request whose
  priority is at or above this (vLLM runs lower values first) is best-effort when it names no
  tier (default 1: any request sent later than vLLM's default priority 0).

A bad value is refused at start-up with a message naming the variable and what to set, before
vLLM allocates anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbank.modelpool import ORDERS
from kvbank.service_class import DEFAULT_MAX_PREEMPTIONS, ServiceClass
from kvbank.vllm.order import DEFAULT_MAX_DEFER_STEPS, DEFAULT_ORDER

POLICIES = ("banker", "banker+backfill", "peak", "peak+backfill")
DEFAULT_POLICY = "peak+backfill"
# vLLM's default request priority is 0 (lower runs first): one sent later than that is
# best-effort under the priority policy unless it names a tier.
DEFAULT_BEST_EFFORT_PRIORITY = 1


class SettingsError(ValueError):
    """A bad environment variable; `variable` names it."""

    def __init__(self, variable: str, message: str) -> None:
        self.variable = variable
        super().__init__(f"{variable}: {message}")


@dataclass(frozen=True)
class Settings:
    policy: str = DEFAULT_POLICY
    sidecar: str | None = None  # host:port or unix:///PATH; None: the embedded ledger
    token: str | None = None
    tls_ca: bytes | None = None
    # Each schedule waits for the sidecar's answers (`kvbank bench --engine vllm --sidecar`, on
    # the virtual clock, where that makes the run the embedded run); never from the environment.
    blocking: bool = False
    default_class: ServiceClass = ServiceClass.STRICT
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    best_effort_priority: int = DEFAULT_BEST_EFFORT_PRIORITY
    order: str = DEFAULT_ORDER
    max_defer_steps: int = DEFAULT_MAX_DEFER_STEPS

    @property
    def peak(self) -> bool:
        return self.policy.startswith("peak")

    @property
    def backfill(self) -> bool:
        return self.policy.endswith("+backfill")


def _shown(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:57] + "...")


def _choice(
    environ: Mapping[str, str], variable: str, what: str, choices: Sequence[str], default: str
) -> str:
    value = environ.get(variable, "").strip() or default
    if value not in choices:
        raise SettingsError(
            variable,
            f"unknown {what} {_shown(value)}; set one of {', '.join(choices)} "
            f"(or leave it unset for {default})",
        )
    return value


def from_env(environ: Mapping[str, str]) -> Settings:
    policy = _choice(environ, "KVBANK_POLICY", "policy", POLICIES, DEFAULT_POLICY)
    sidecar = environ.get("KVBANK_SIDECAR", "").strip() or None
    classes = {**_classes(environ), **_order(environ)}
    token_file = environ.get("KVBANK_SIDECAR_TOKEN_FILE", "").strip() or None
    ca_file = environ.get("KVBANK_SIDECAR_CA_FILE", "").strip() or None
    if sidecar is None:
        for name, value in (
            ("KVBANK_SIDECAR_TOKEN_FILE", token_file),
            ("KVBANK_SIDECAR_CA_FILE", ca_file),
        ):
            if value is not None:
                raise SettingsError(
                    name,
                    "is set but KVBANK_SIDECAR is not; set KVBANK_SIDECAR=host:port or unset it",
                )
        return Settings(policy, **classes)
    host, sep, port = sidecar.rpartition(":")
    if sidecar.startswith("unix:"):
        if not sidecar.startswith("unix:///") or len(sidecar) == len("unix:///"):
            raise SettingsError(
                "KVBANK_SIDECAR",
                f"{_shown(sidecar)} is not unix:///PATH with an absolute path "
                f"(e.g. unix:///var/run/kvbank/sidecar.sock)",
            )
    elif not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(
            "KVBANK_SIDECAR",
            f"{_shown(sidecar)} is not host:port (e.g. 127.0.0.1:50051) or unix:///PATH",
        )
    token = None
    if token_file is not None:
        token = _read(token_file, "KVBANK_SIDECAR_TOKEN_FILE").decode().strip()
        if not token:
            raise SettingsError(
                "KVBANK_SIDECAR_TOKEN_FILE", f"{_shown(token_file)} is empty; write the token in it"
            )
    tls_ca = _read(ca_file, "KVBANK_SIDECAR_CA_FILE") if ca_file is not None else None
    return Settings(policy, sidecar, token, tls_ca, **classes)


def _classes(environ: Mapping[str, str]) -> dict[str, Any]:
    """The class settings (kvbank.vllm.classes), as Settings' keyword arguments."""
    names = [c.value for c in ServiceClass]
    default = _choice(environ, "KVBANK_DEFAULT_CLASS", "class", names, ServiceClass.STRICT.value)
    preemptions = _count(
        environ, "KVBANK_MAX_PREEMPTIONS", DEFAULT_MAX_PREEMPTIONS,
        "the times a best-effort request may be preempted before it runs strict",
    )  # fmt: skip
    priority = _integer(environ, "KVBANK_BEST_EFFORT_PRIORITY", DEFAULT_BEST_EFFORT_PRIORITY)
    return {
        "default_class": ServiceClass(default),
        "max_preemptions": preemptions,
        "best_effort_priority": priority,
    }


def _order(environ: Mapping[str, str]) -> dict[str, Any]:
    """The order settings (kvbank.vllm.order), as Settings' keyword arguments."""
    order = _choice(environ, "KVBANK_ORDER", "order", ORDERS, DEFAULT_ORDER)
    steps = _count(
        environ, "KVBANK_MAX_DEFER_STEPS", DEFAULT_MAX_DEFER_STEPS,
        "the admission passes a request may be moved behind later ones",
    )  # fmt: skip
    return {"order": order, "max_defer_steps": steps}


def _count(environ: Mapping[str, str], variable: str, default: int, what: str) -> int:
    """A non-negative integer setting; `what` says what it counts."""
    value = _integer(environ, variable, default)
    if value < 0:
        raise SettingsError(
            variable, f"is {value}; set {what}, 0 or more (or leave it unset for {default})"
        )
    return value


def _integer(environ: Mapping[str, str], variable: str, default: int) -> int:
    value = environ.get(variable, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SettingsError(
            variable, f"{_shown(value)} is not an integer (or leave it unset for {default})"
        ) from None


def _read(path: str, variable: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(variable, f"cannot read {_shown(path)}: {exc.strerror}") from None
