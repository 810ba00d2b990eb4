"""The operator's flags. Every flag has an environment variable, so the chart can set them either
way and a developer can run the operator locally with a kubeconfig."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvbank.deployment import PodTemplate, parse_template
from kvbank.fields import SpecError
from kvbank.operator.certs import service_names
from kvbank.operator.render.names import RenderSettings
from kvbank.operator.webhook_tls import TLSSettings

CERT_MODES = ("self-signed", "cert-manager", "none")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _int_env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _float_env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    api = parser.add_argument_group("Kubernetes API")
    api.add_argument(
        "--kubeconfig",
        default=_env("KUBECONFIG"),
        help="kubeconfig file; default: in-cluster ServiceAccount, then ~/.kube/config",
    )
    api.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        default=[n for n in (_env("KVBANK_WATCH_NAMESPACES") or "").split(",") if n],
        help="watch only this namespace (repeatable; env KVBANK_WATCH_NAMESPACES, "
        "comma-separated); default: every namespace",
    )
    api.add_argument(
        "--peering",
        default=_env("KVBANK_PEERING", ""),
        help="kopf peering object to share with the operator's other replicas (a "
        "ClusterKopfPeering, or a KopfPeering in each --namespace): the replica of the highest "
        "priority reconciles, every replica serves the webhook (env KVBANK_PEERING); "
        "'' runs standalone, one replica only",
    )
    api.add_argument(
        "--api-timeout",
        type=float,
        default=_float_env("KVBANK_API_TIMEOUT", 10.0),
        help="seconds per Kubernetes API request",
    )

    hook = parser.add_argument_group("validating webhook")
    hook.add_argument(
        "--webhook-listen",
        default=_env("KVBANK_WEBHOOK_LISTEN", "0.0.0.0"),
        help="address the webhook server binds",
    )
    hook.add_argument(
        "--webhook-port",
        type=int,
        default=_int_env("KVBANK_WEBHOOK_PORT", 9443),
        help="port the webhook server listens on (env KVBANK_WEBHOOK_PORT)",
    )
    hook.add_argument(
        "--cert-mode",
        choices=CERT_MODES,
        default=_env("KVBANK_CERT_MODE", "self-signed"),
        help="self-signed: the operator keeps its own CA in a Secret and patches "
        "the CA bundle; cert-manager: serve the files cert-manager mounts; none: "
        "serve no webhook (CEL and reconcile still judge every spec)",
    )
    hook.add_argument(
        "--operator-namespace",
        default=_env("KVBANK_OPERATOR_NAMESPACE", _env("POD_NAMESPACE", "kvbank-system")),
        help="namespace of the webhook Service and certificate Secret",
    )
    hook.add_argument(
        "--webhook-service",
        default=_env("KVBANK_WEBHOOK_SERVICE", "kvbank-webhook"),
        help="Service name the apiserver calls (the certificate's DNS names)",
    )
    hook.add_argument(
        "--webhook-secret",
        default=_env("KVBANK_WEBHOOK_SECRET", "kvbank-webhook-tls"),
        help="Secret holding the self-signed CA and serving certificate",
    )
    hook.add_argument(
        "--webhook-configuration",
        default=_env("KVBANK_WEBHOOK_CONFIGURATION", "kvbank-operator"),
        help="ValidatingWebhookConfiguration whose caBundle is patched ('' for none)",
    )
    hook.add_argument(
        "--webhook-cert-dir",
        type=Path,
        default=_env("KVBANK_WEBHOOK_CERT_DIR"),
        help="cert-manager mode: directory with tls.crt and tls.key",
    )
    hook.add_argument(
        "--webhook-extra-san",
        action="append",
        default=[],
        help="another DNS name or IP for the certificate (repeatable)",
    )
    hook.add_argument(
        "--cert-check-interval",
        type=float,
        default=_float_env("KVBANK_CERT_CHECK_INTERVAL", 3600.0),
        help="seconds between certificate renewal checks",
    )

    status = parser.add_argument_group("status")
    status.add_argument(
        "--status-interval",
        type=float,
        default=_float_env("KVBANK_STATUS_INTERVAL", 30.0),
        help="seconds between reads of the sidecars' live figures",
    )
    status.add_argument(
        "--status-concurrency",
        type=int,
        default=_int_env("KVBANK_STATUS_CONCURRENCY", 8),
        help="sidecars asked at once, per pool",
    )
    status.add_argument(
        "--sidecar-token",
        default=_env("KVBANK_SIDECAR_TOKEN"),
        help="shared token every rendered sidecar requires of its engine and of the operator's "
        "status reads (env KVBANK_SIDECAR_TOKEN, which the chart sets from its Secret); "
        "without it no pool's pods are rendered",
    )
    status.add_argument(
        "--status-timeout",
        type=float,
        default=_float_env("KVBANK_STATUS_TIMEOUT", 2.0),
        help="seconds one sidecar has to answer",
    )

    status.add_argument(
        "--repair-interval",
        type=float,
        default=_float_env("KVBANK_REPAIR_INTERVAL", 30.0),
        help="seconds between checks that each pool's objects are there as rendered (a "
        "deleted StatefulSet or Service, a hand-edited replica count are put back)",
    )

    pods = parser.add_argument_group("rendered pods")
    pods.add_argument(
        "--image", default=_env("KVBANK_IMAGE", RenderSettings.image), help="engine + sidecar image"
    )
    pods.add_argument(
        "--vllm-image",
        default=_env("KVBANK_VLLM_IMAGE", RenderSettings.vllm_image),
        help="engine image of spec.engine.kind vllm pools that name none (vLLM and kvbank)",
    )
    pods.add_argument(
        "--image-volumes",
        action=argparse.BooleanOptionalAction,
        default=(_env("KVBANK_IMAGE_VOLUMES", "false") or "").lower() in ("1", "true", "yes"),
        help="mount an image weights source as an image volume (the cluster has the "
        "ImageVolume feature) instead of copying it into an emptyDir at every start",
    )
    pods.add_argument(
        "--pool-template",
        default=_env("KVBANK_POOL_TEMPLATE", ""),
        help="JSON: defaults for every pool's spec.template (nodeSelector, tolerations, "
        "resources, shmSize...); the chart sets it from pools.template",
    )
    pods.add_argument(
        "--image-pull-policy",
        default=_env("KVBANK_IMAGE_PULL_POLICY", "IfNotPresent"),
        help="imagePullPolicy of the rendered containers",
    )
    pods.add_argument(
        "--gpu-resource",
        default=_env("KVBANK_GPU_RESOURCE", "nvidia.com/gpu"),
        help="extended resource each rank's pod requests (spec.template.resources.gpusPerRank "
        "of it, one per rank unless set) (default: %(default)s)",
    )
    pods.add_argument(
        "--model-root",
        default=_env("KVBANK_MODEL_ROOT", "/models"),
        help="folder holding each model's weights as MODEL_ROOT/spec.model.name",
    )
    pods.add_argument(
        "--termination-grace-seconds",
        type=int,
        default=_int_env("KVBANK_TERMINATION_GRACE_SECONDS", 600),
        help="how long a replaced pod may finish its admitted requests",
    )
    pods.add_argument(
        "--liveness",
        default=_env("KVBANK_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="kopf liveness endpoint ('' for none)",
    )


def pool_template(raw: str | None) -> PodTemplate:
    """The chart's pools.template, checked as a pool's spec.template is: a bad default stops
    the operator at start, naming the field, rather than refusing every pool later."""
    if not raw or not raw.strip():
        return PodTemplate()
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise SystemExit(f"--pool-template (KVBANK_POOL_TEMPLATE) is not JSON: {exc}") from exc
    try:
        return parse_template(doc, "pools.template")
    except SpecError as exc:
        lines = "".join(f"\n  - {e}" for e in exc.errors)
        raise SystemExit(
            f"--pool-template (the chart's pools.template) is invalid:{lines}"
        ) from exc


def sidecar_token(raw: str | None) -> str | None:
    """The token as the sidecar will read it from its file (stripped: a Secret made with `echo`
    ends in a newline). It travels as gRPC metadata, which takes printable ASCII only; a bad
    token stops the operator here, never as a refused call in every pod."""
    token = (raw or "").strip()
    if not token:
        return None
    bad = sorted({c for c in token if not 0x21 <= ord(c) <= 0x7E})
    if bad:
        raise SystemExit(
            f"--sidecar-token (KVBANK_SIDECAR_TOKEN) has {len(bad)} kind(s) of character gRPC "
            "metadata cannot carry (spaces, control or non-ASCII characters): use printable "
            "ASCII, e.g. `openssl rand -hex 32`"
        )
    return token


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None
    namespaces: tuple[str, ...]
    peering: str | None
    api_timeout: float
    webhook_listen: str
    webhook_port: int
    tls: TLSSettings
    cert_check_interval: float
    status_interval: float
    status_concurrency: int
    status_timeout: float
    repair_interval: float
    sidecar_token: str | None = field(repr=False)
    render: RenderSettings
    liveness: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OperatorConfig:
        if args.cert_mode == "cert-manager" and not args.webhook_cert_dir:
            raise SystemExit("--cert-mode cert-manager needs --webhook-cert-dir (tls.crt, tls.key)")
        token = sidecar_token(args.sidecar_token)
        names = service_names(
            args.webhook_service, args.operator_namespace, tuple(args.webhook_extra_san)
        )
        return cls(
            kubeconfig=args.kubeconfig,
            namespaces=tuple(args.namespaces),
            peering=args.peering or None,
            api_timeout=args.api_timeout,
            webhook_listen=args.webhook_listen,
            webhook_port=args.webhook_port,
            tls=TLSSettings(
                mode=args.cert_mode,
                secret_name=args.webhook_secret,
                namespace=args.operator_namespace,
                names=names,
                webhook_configuration=args.webhook_configuration or None,
                cert_dir=Path(args.webhook_cert_dir) if args.webhook_cert_dir else None,
            ),
            cert_check_interval=args.cert_check_interval,
            status_interval=args.status_interval,
            status_concurrency=args.status_concurrency,
            status_timeout=args.status_timeout,
            repair_interval=args.repair_interval,
            sidecar_token=token,
            render=RenderSettings(
                image=args.image,
                vllm_image=args.vllm_image,
                image_volumes=args.image_volumes,
                template_defaults=pool_template(args.pool_template),
                image_pull_policy=args.image_pull_policy,
                gpu_resource=args.gpu_resource,
                model_root=args.model_root,
                termination_grace_seconds=args.termination_grace_seconds,
                sidecar_token=token,
            ),
            liveness=args.liveness or None,
        )
