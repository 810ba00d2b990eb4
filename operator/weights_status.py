"""The pool's `WeightsAvailable` condition: whether what `spec.model.source` names is there.

Two readings, each where it can be made without reading the weights themselves:
- before any pod runs (reconcile and the repair timer): a `pvc` source's claim exists and is
  Bound — a missing or unbound claim leaves every pod Pending with only an event to say why;
- once pods run (the live timer): a rank's `weights-check` init container that exited non-zero
  left its log line as its termination message (FallbackToLogsOnError), which says what is
  missing inside the volume (no config.json, no safetensors, an unreadable folder).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvbank.deployment import (
    Deployment,
    HostPathSource,
    HuggingFaceSource,
    ImageSource,
    PvcSource,
)
from kvbank.operator.cluster import Cluster
from kvbank.operator.render.status import Condition
from kvbank.operator.render.weights import CHECK_CONTAINER

WEIGHTS = "WeightsAvailable"


def claim_condition(
    namespace: str, source: PvcSource, claim: Mapping[str, Any] | None
) -> Condition:
    where = f"PersistentVolumeClaim {namespace}/{source.claim_name}"
    if claim is None:
        return Condition(
            WEIGHTS,
            False,
            "ClaimNotFound",
            f"{where} does not exist: create it holding the model folder"
            + (f" at {source.sub_path}" if source.sub_path else "")
            + ", or set spec.model.source.pvc.claimName to a claim that does. The pods stay "
            "Pending until it exists.",
        )
    phase = (claim.get("status") or {}).get("phase") or "Pending"
    if phase != "Bound":
        return Condition(
            WEIGHTS,
            False,
            "ClaimNotBound",
            f"{where} is {phase}, not Bound: no PersistentVolume matches its storageClassName, "
            "size and accessModes yet (a WaitForFirstConsumer class binds when the first pod "
            "is scheduled). The pods stay Pending until it binds.",
        )
    volume = (claim.get("spec") or {}).get("volumeName") or "?"
    return Condition(WEIGHTS, True, "ClaimBound", f"{where} is Bound to PersistentVolume {volume}")


async def source_condition(cluster: Cluster, namespace: str, deployment: Deployment) -> Condition:
    source = deployment.source
    if isinstance(source, PvcSource):
        claim = await cluster.get("v1", "PersistentVolumeClaim", source.claim_name, namespace)
        return claim_condition(namespace, source, claim)
    if isinstance(source, HostPathSource):
        return Condition(
            WEIGHTS, True, "HostPath", f"read from {source.path} on each node (development only)"
        )
    if isinstance(source, ImageSource):
        return Condition(
            WEIGHTS, True, "CopiedAtStart", f"copied from {source.reference} as each pod starts"
        )
    if isinstance(source, HuggingFaceSource):
        return Condition(
            WEIGHTS, True, "DownloadedAtStart", f"downloaded from {source.repo} as each pod starts"
        )
    return Condition(WEIGHTS, True, "InImage", "the engine image holds the weights")


def failed_checks(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """ "pod: log line" for every pod whose weights check last exited non-zero."""
    failures = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if status.get("name") != CHECK_CONTAINER:
                continue
            for state in (status.get("state") or {}, status.get("lastState") or {}):
                done = state.get("terminated") or {}
                if done.get("exitCode"):
                    message = str(done.get("message") or done.get("reason") or "").strip()
                    failures.append(f"{name}: {message.splitlines()[-1] if message else 'failed'}")
                    break
    return failures


def check_condition(pods: Iterable[Mapping[str, Any]]) -> Condition | None:
    """WeightsAvailable=False from the pods' weights checks; None when none failed (the
    source's own reading stands)."""
    failures = failed_checks(pods)
    if not failures:
        return None
    shown = "; ".join(failures[:3]) + (
        f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
    )
    return Condition(
        WEIGHTS,
        False,
        "WeightsCheckFailed",
        f"{len(failures)} pod(s) found no usable weights where --model looks: {shown}",
    )
