"""What makes a rank pod pass Pod Security "restricted", and the writable folders it needs for
that: the pod and container security contexts, the scratch volumes that stand in for a
read-only root filesystem, the probes and the resources of the containers that are not the
engine (the engine's are the spec's: render.scheduling).

These are the operator's, never the spec's: `spec.template.securityContext` may only add
supplementalGroups, an SELinux type and level and an AppArmor profile, every one of which
restricted allows (the parser refuses any other field, naming it), and the hardened fields are
laid over what it adds, so no pool can weaken them. Every container, init containers
included, gets the same context; an init container running a user's image (weights-copy)
runs as the same non-root user, which `cp` into an emptyDir needs nothing more than.

The uid is the images' own user (containers/*.Containerfile and tests/e2e/node/images.sh
both create 10001); a numeric runAsUser lets the kubelet enforce runAsNonRoot without reading
the image's /etc/passwd.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from kvbank.deployment import SecurityAdditions

RUN_AS_USER = 10001
SCRATCH_VOLUME = "tmp"
SCRATCH_DIR = "/tmp"
SCRATCH_LIMIT = "1Gi"
# HOME and every cache the engine's libraries write (torch's inductor, triton, flashinfer's
# JIT, vLLM's compile cache, Hugging Face): each follows HOME or XDG_CACHE_HOME, or is named.
CACHE_VOLUME = "cache"
CACHE_DIR = "/var/cache/kvbank"
CACHE_LIMIT = "16Gi"

# Weights load before the engine listens: a startup probe, not the liveness probe, waits for
# them, for up to STARTUP_PERIOD x STARTUP_FAILURES seconds (30 minutes: a 70B checkpoint read
# from network storage), and liveness only starts counting once the engine answered once.
STARTUP_PERIOD = 5
STARTUP_FAILURES = 360
PROBE_TIMEOUT = 5

# The sidecar's ledger is a few integers per request: 57 MiB resident at start (measured),
# far less than its limit. No CPU limit anywhere: CFS throttling a sidecar would delay
# admission decisions, and the engine's CPU is the spec's to size.
SIDECAR_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
# A POSIX shell looking at a folder.
CHECK_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
# `cp` of the weights; the page cache it fills is reclaimable, not its own.
COPY_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
# huggingface_hub streaming shards to disk, a few in parallel.
DOWNLOAD_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}


def pod_security_context(additions: SecurityAdditions | None = None) -> dict[str, Any]:
    """fsGroup gives the pod's group the volumes whose ownership the kubelet manages (emptyDirs,
    a claim that supports it); OnRootMismatch keeps a large weights claim from being walked at
    every start. `additions`: what spec.template.securityContext adds, under the hardening."""
    added: dict[str, Any] = {}
    if additions is not None:
        if additions.supplemental_groups:
            added["supplementalGroups"] = list(additions.supplemental_groups)
        if additions.se_linux_options:
            added["seLinuxOptions"] = dict(additions.se_linux_options)
        if additions.app_armor_profile:
            added["appArmorProfile"] = dict(additions.app_armor_profile)
    return {
        **added,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def scratch_volumes() -> list[dict[str, Any]]:
    return [
        {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": SCRATCH_LIMIT}},
        {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": CACHE_LIMIT}},
    ]


def scratch_mount() -> dict[str, Any]:
    return {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}


def cache_mount() -> dict[str, Any]:
    return {"name": CACHE_VOLUME, "mountPath": CACHE_DIR}


def cache_env() -> list[dict[str, Any]]:
    """The engine's writable HOME and caches, on the cache volume."""
    return [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{CACHE_DIR}/.cache"},
        {"name": "XDG_CONFIG_HOME", "value": f"{CACHE_DIR}/.config"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/.cache/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/.cache/torchinductor"},
    ]


def harden(container: dict[str, Any]) -> dict[str, Any]:
    """The container with the restricted security context and a writable /tmp."""
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] != SCRATCH_DIR]
    return {
        **container,
        "securityContext": container_security_context(),
        "volumeMounts": [*mounts, scratch_mount()],
    }


# The engine's two questions (engine/serve/http/app.py): whether it runs at all, and whether it
# can admit now (a lost sidecar drains the pod but must not restart it: its running requests
# keep their pages and finish).
LIVE_PATH = "/health/live"
READY_PATH = "/health"


def engine_probes(port: str, live_path: str = LIVE_PATH) -> dict[str, Any]:
    """Probes of the engine's HTTP `port`. Startup and liveness ask /health/live, which turns
    503 only when the engine loop has stopped, which no wait repairs, so liveness restarts the
    container then; readiness asks /health, which also fails while the engine cannot admit (its
    sidecar is unreachable), so the Service drains the pod until the sidecar is back. A
    follower rank answers both while it runs. vLLM serves /health alone (`live_path`)."""
    live = {"httpGet": {"path": live_path, "port": port}}
    return {
        "startupProbe": {
            **deepcopy(live),
            "periodSeconds": STARTUP_PERIOD,
            "timeoutSeconds": PROBE_TIMEOUT,
            "failureThreshold": STARTUP_FAILURES,
        },
        "readinessProbe": {
            "httpGet": {"path": READY_PATH, "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            **deepcopy(live),
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT,
            "failureThreshold": 6,
        },
    }


def sidecar_probes(probe: dict[str, Any]) -> dict[str, Any]:
    """The sidecar reads one small file at start: a minute is long for its startup."""
    return {
        "startupProbe": {**deepcopy(probe), "periodSeconds": 2, "failureThreshold": 30},
        "readinessProbe": {**deepcopy(probe), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **deepcopy(probe),
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT,
            "failureThreshold": 6,
        },
    }
