"""`kvbank operator`: run the ModelPool operator (kopf) against the cluster of a kubeconfig or the
in-cluster ServiceAccount. Flags and the API access it needs: docs/operator.md."""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from typing import NamedTuple

from kvbank.operator import config as operator_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    operator_config.add_arguments(parser)
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        # Before the Kubernetes client is imported: it reads KUBECONFIG once, at import, and
        # kopf's login (kopf.login_via_client) must find the same file as the project's client.
        os.environ["KUBECONFIG"] = args.kubeconfig
    # kopf, the Kubernetes client and cryptography load only when the operator runs.
    import kopf

    from kvbank.operator.handlers import Runtime, register
    from kvbank.operator.kube import KubeClient, NoCluster, load_api_client
    from kvbank.operator.live import SidecarClientSource
    from kvbank.operator.webhook_tls import ServerTLS

    config = operator_config.OperatorConfig.from_args(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        api = load_api_client(config.kubeconfig)
    except NoCluster as exc:
        print(f"kvbank operator: {exc}", file=sys.stderr)
        return 2
    cluster = KubeClient(api, timeout=config.api_timeout)
    runtime = Runtime(
        config=config,
        cluster=cluster,
        source=SidecarClientSource(config.sidecar_token),
        tls=None if config.tls.mode == "none" else ServerTLS(),
    )
    registry = kopf.OperatorRegistry()
    register(registry, runtime)
    chosen = peering(config.peering)
    kopf.run(
        registry=registry,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=config.liveness,
        standalone=chosen.standalone,
        peering_name=chosen.name,
        priority=chosen.priority,
    )
    return 0


class Peering(NamedTuple):
    standalone: bool
    name: str | None = None
    priority: int | None = None


def peering(name: str | None) -> Peering:
    """kopf's peering: of the replicas sharing `name`, the one of the highest priority handles
    the pools and the others pause their handlers and timers (their webhook servers keep
    answering). Replicas of equal priority would all pause, so each draws its own at start; a
    replica that stops leaves the peering at once, and one killed is forgotten after kopf's
    60 s lifetime, when the next resumes. No name: standalone, for a single replica."""
    if name is None:
        return Peering(standalone=True)
    return Peering(standalone=False, name=name, priority=random.randrange(1, 1 << 31))
