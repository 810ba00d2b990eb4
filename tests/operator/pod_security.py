"""A pod spec judged by the Pod Security Standards' "restricted" profile, written from the
published rules (kubernetes.io/docs/concepts/security/pod-security-standards), baseline's
controls included since restricted is cumulative. `violations` returns one line per broken
control naming the field, so a test failure says what to fix.

Pod Security admission would judge a rendered StatefulSet's template the same way (it checks
workload templates as warnings and pods as enforcement); no apiserver runs in the unit tests,
so this is that judgement, as the standard states it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
APPARMOR_ALLOWED = {"RuntimeDefault", "Localhost"}


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate(spec.get(kind) or []):
            yield f"spec.{kind}[{i}]({container.get('name')})", container


def _baseline(spec: Mapping[str, Any], annotations: Mapping[str, str]) -> list[str]:
    out = []
    pod_ctx = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            out.append(f"spec.{flag} must be false (host namespaces)")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess must be false")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls {sysctl.get('name')} is not a safe sysctl")
    for i, volume in enumerate(spec.get("volumes") or []):
        if "hostPath" in volume:
            out.append(f"spec.volumes[{i}]({volume.get('name')}) is a hostPath volume")
    for key, value in annotations.items():
        apparmor_key = key.startswith("container.apparmor.security.beta.kubernetes.io/")
        if apparmor_key and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"annotation {key}={value} is not an allowed AppArmor profile")
    contexts = [("spec.securityContext", pod_ctx)]
    for at, container in _containers(spec):
        ctx = container.get("securityContext") or {}
        contexts.append((f"{at}.securityContext", ctx))
        if ctx.get("privileged"):
            out.append(f"{at}.securityContext.privileged must be false")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{at}.securityContext.windowsOptions.hostProcess must be false")
        added = set((ctx.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{at}.securityContext.capabilities.add {sorted(added)} beyond baseline")
        if ctx.get("procMount") not in (None, "Default"):
            out.append(f"{at}.securityContext.procMount must be Default")
        for j, port in enumerate(container.get("ports") or []):
            if port.get("hostPort"):
                out.append(f"{at}.ports[{j}].hostPort must be unset or 0")
    for at, ctx in contexts:
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES:
            out.append(f"{at}.seLinuxOptions.type {selinux['type']} is not allowed")
        if selinux.get("user") or selinux.get("role"):
            out.append(f"{at}.seLinuxOptions user and role must be unset")
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{at}.seccompProfile.type must not be Unconfined")
        apparmor = (ctx.get("appArmorProfile") or {}).get("type")
        if apparmor is not None and apparmor not in APPARMOR_ALLOWED:
            out.append(f"{at}.appArmorProfile.type {apparmor} is not allowed")
    return out


def _restricted(spec: Mapping[str, Any]) -> list[str]:
    out = []
    pod_ctx = spec.get("securityContext") or {}
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"spec.volumes[{i}]({volume.get('name')}) is of type {sorted(kinds)}")
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type") in SECCOMP_ALLOWED
    if pod_ctx.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser must not be 0")
    for at, container in _containers(spec):
        ctx = container.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{at}.securityContext.allowPrivilegeEscalation must be false")
        non_root = ctx.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{at}.securityContext.runAsNonRoot must be true (here or on the pod)")
        if ctx.get("runAsUser") == 0:
            out.append(f"{at}.securityContext.runAsUser must not be 0")
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if seccomp is None and not pod_seccomp:
            out.append(f"{at}.securityContext.seccompProfile must be RuntimeDefault or Localhost")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            out.append(f"{at}.securityContext.capabilities.drop must include ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{at}.securityContext.capabilities.add may hold only NET_BIND_SERVICE")
    return out


def violations(template: Mapping[str, Any]) -> list[str]:
    """`template`: a pod, or a workload's pod template ({metadata, spec})."""
    spec = template.get("spec") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return _baseline(spec, annotations) + _restricted(spec)
