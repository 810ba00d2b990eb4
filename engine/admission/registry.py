"""The engine's admission policies by name: the ledger's modes (kvbank/mode.py) and the
baselines, in the order `kvbank bench --policy all` runs them. One table, built when this module
is imported, so nothing depends on which policy module was imported first."""

from __future__ import annotations

from collections.abc import Callable

from kvbank.engine.admission.baselines import BASELINES
from kvbank.engine.admission.ledger_policy import LedgerPolicy
from kvbank.engine.admission.policy import AdmissionPolicy
from kvbank.ledger.client import LedgerClient
from kvbank.mode import BANKER, LEDGER_MODES, AdmissionMode
from kvbank.service_class import ClassPolicy

PolicyFactory = Callable[[LedgerClient | None, ClassPolicy], AdmissionPolicy]


def _ledger(mode: AdmissionMode) -> PolicyFactory:
    def make(backend: LedgerClient | None, classes: ClassPolicy) -> AdmissionPolicy:
        return LedgerPolicy(mode, backend, classes)

    return make


def _baseline(cls: type[AdmissionPolicy]) -> PolicyFactory:
    return lambda backend, classes: cls()


# The banker first (the design), then the baselines, then the ledger's other modes.
POLICIES: dict[str, PolicyFactory] = {
    BANKER.name: _ledger(BANKER),
    **{cls.name: _baseline(cls) for cls in BASELINES},
    **{mode.name: _ledger(mode) for mode in LEDGER_MODES if mode != BANKER},
}


def make_policy(
    name: str, backend: LedgerClient | None = None, classes: ClassPolicy | None = None
) -> AdmissionPolicy:
    """The policy `name`; `classes` are the pool's class settings, for the policies that honour
    classes (engine/admission/besteffort.py)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
    return factory(backend, classes or ClassPolicy())


def policy_names() -> list[str]:
    return list(POLICIES)
