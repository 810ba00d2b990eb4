"""The kopf handlers: decorators only, each a call into the logic modules. `register` binds them
to a registry and a Runtime, so tests register them with a fake cluster and call them directly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf

from kvbank.modelpool import API_GROUP, API_VERSION
from kvbank.operator import admission, live, model_config, reconcile
from kvbank.operator.certs import CertBundle
from kvbank.operator.cluster import Cluster, KubeError, KubeUnavailable
from kvbank.operator.config import OperatorConfig
from kvbank.operator.webhook_tls import CA_RETRY_S, ServerTLS, refresh_tls

log = logging.getLogger(__name__)
T = TypeVar("T")
POOLS = (API_GROUP, API_VERSION, "modelpools")
POLICIES = (API_GROUP, API_VERSION, "capacitypolicies")
CONFIG_MAPS = ("v1", "configmaps")
RETRY_UNAVAILABLE = 10.0  # seconds; the API was down or slow
RETRY_REFUSED = 60.0  # seconds; the API refused a request (RBAC being installed, say)


@dataclass
class Runtime:
    config: OperatorConfig
    cluster: Cluster
    source: live.SidecarStatusSource
    tls: ServerTLS | None


async def _guarded(call: Awaitable[T]) -> T:
    """API failures become kopf retries with a delay, never a crashed handler."""
    try:
        return await call
    except KubeUnavailable as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_UNAVAILABLE) from exc
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_REFUSED) from exc


def configure(settings: kopf.OperatorSettings, rt: Runtime) -> None:
    # Progress lives in annotations: the ModelPool status schema stays exactly ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.level = logging.WARNING
    # No watch on CRDs or namespaces (least RBAC): the CRDs are installed before the operator,
    # and kopf's one discovery at start finds them.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = rt.config.api_timeout * 3
    if rt.tls is not None:
        settings.admission.server = kopf.WebhookServer(
            addr=rt.config.webhook_listen,
            port=rt.config.webhook_port,
            certfile=str(rt.tls.cert_file),
            pkeyfile=str(rt.tls.key_file),
            context=rt.tls.context,
        )
        settings.admission.managed = None  # the chart owns the configuration; we patch its CA


def share_ca(rt: Runtime) -> None:
    """The status reader trusts the CA that signs the pools' sidecar certificates."""
    ca = rt.tls.issuer.ca_bundle if rt.tls is not None and rt.tls.issuer is not None else None
    if isinstance(rt.source, live.SidecarClientSource):
        rt.source.ca_bundle = ca


def now() -> datetime:
    return datetime.now(UTC)


async def renew_forever(rt: Runtime) -> None:
    assert rt.tls is not None
    while True:
        # A webhook configuration not yet there to take the CA is looked for again soon.
        wait = CA_RETRY_S if rt.tls.ca_pending else rt.config.cert_check_interval
        await asyncio.sleep(min(wait, rt.config.cert_check_interval))
        try:
            if await refresh_tls(rt.cluster, rt.config.tls, rt.tls, now()):
                log.info("webhook certificate renewed")
            share_ca(rt)
        except (KubeError, OSError, RuntimeError) as exc:
            log.error("webhook certificate renewal failed, retrying next interval: %s", exc)


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A fresh registry has none of kopf's default login handlers; this is the one for the
        # same kubeconfig or in-cluster token the project's client uses (KUBECONFIG is set).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings, rt)
        if rt.tls is not None:
            await _guarded(refresh_tls(rt.cluster, rt.config.tls, rt.tls, now()))
            share_ca(rt)
            memo["renewal"] = asyncio.create_task(renew_forever(rt))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        task = memo.get("renewal")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if rt.tls is not None:
            rt.tls.close()

    if rt.tls is not None:  # kopf refuses to start with webhook handlers and no server
        register_webhooks(registry, rt)

    # Explicit ids: kopf keys its progress annotations by them (kvbank.dev/reconcile), and a
    # name derived from a closure ("register.<locals>...") would change with any refactor.
    @kopf.on.resume(*POOLS, id="reconcile", registry=registry)
    @kopf.on.create(*POOLS, id="reconcile", registry=registry)
    @kopf.on.update(*POOLS, id="reconcile", registry=registry)
    async def reconcile_pool(body: kopf.Body, logger: Any, **_: Any) -> None:
        outcome = await _guarded(
            reconcile.reconcile(rt.cluster, rt.config.render, body, issuer=issuer(rt))
        )
        if outcome.accepted:
            logger.info("applied %s", ", ".join(outcome.applied))
        else:
            logger.warning("refused: %s", outcome.message)

    # Reconcile runs when the pool changes; this is what puts back a child that vanished or
    # was edited by hand, and renews the pool's sidecar certificate.
    @kopf.timer(*POOLS, id="repair", interval=rt.config.repair_interval, registry=registry)
    async def repair_pool(body: kopf.Body, logger: Any, **_: Any) -> None:
        outcome = await _guarded(
            reconcile.repair(rt.cluster, rt.config.render, body, issuer=issuer(rt))
        )
        if outcome is not None and outcome.applied:
            # The pool in the message itself: the log's format may not name the object.
            where = f"{body['metadata'].get('namespace')}/{body['metadata']['name']}"
            logger.warning("%s: restored %s", where, ", ".join(outcome.applied))

    # The pools that take their config.json from a ConfigMap, by (namespace, name) of that
    # ConfigMap: an edit of it is a change of what the pool was judged on.
    @kopf.index(*POOLS, id="pools_by_config_map", registry=registry)
    def pools_by_config_map(body: kopf.Body, **_: Any) -> dict[tuple[str, str], str]:
        ref = model_config.config_map_of(body)
        return {} if ref is None else {ref: str(body["metadata"]["name"])}

    def referenced(name: str, namespace: str | None, **kwargs: Any) -> bool:
        return (namespace, name) in kwargs["pools_by_config_map"]

    # A watch event, not a change handler: nothing is written to the user's ConfigMap. An event
    # lost to an API failure is caught up by the repair timer, which judges a config it has
    # not judged before rendering it.
    @kopf.on.event(*CONFIG_MAPS, id="model-config", when=referenced, registry=registry)
    async def config_map_changed(
        type: str, name: str, namespace: str | None, logger: Any, **kwargs: Any
    ) -> None:
        if type is None or namespace is None:
            return  # the initial listing: every pool is reconciled on resume anyway
        pools = list(kwargs["pools_by_config_map"].get((namespace, name), ()))
        outcomes = await _guarded(
            reconcile.rejudge(
                rt.cluster, rt.config.render, namespace, name, pools, issuer=issuer(rt)
            )
        )
        for outcome in outcomes:
            if not outcome.accepted:
                logger.warning("ConfigMap %s/%s changed; refused: %s", namespace, name,
                               outcome.message)  # fmt: skip

    @kopf.timer(*POOLS, id="status", interval=rt.config.status_interval, registry=registry)
    async def pool_status(body: kopf.Body, **_: Any) -> None:
        await _guarded(
            live.refresh(
                rt.cluster,
                rt.source,
                body,
                port=rt.config.render.sidecar_port,
                concurrency=rt.config.status_concurrency,
                timeout=rt.config.status_timeout,
                now=reconcile.utc_now(),
            )
        )


def issuer(rt: Runtime) -> CertBundle | None:
    return rt.tls.issuer if rt.tls is not None else None


def register_webhooks(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    defaults = rt.config.render.template_defaults

    @kopf.on.validate(
        *POOLS, id="validate-modelpool", operations=["CREATE", "UPDATE"], registry=registry
    )
    async def validate_modelpool(body: kopf.Body, **kwargs: Any) -> None:
        try:
            refusal = await admission.review(
                rt.cluster,
                body,
                kwargs.get("old"),
                defaults=defaults,
                warnings=kwargs.get("warnings"),  # kopf's list, which kubectl prints
            )
        except KubeError as exc:
            raise kopf.AdmissionError(f"cannot judge the ModelPool now: {exc}", code=503) from exc
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)

    @kopf.on.validate(
        *POOLS,
        id="validate-modelpool-scale",
        subresource="scale",
        operations=["UPDATE"],
        registry=registry,
    )
    async def validate_scale(
        body: kopf.Body, name: str | None, namespace: str | None, **_: Any
    ) -> None:
        replicas = (body.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or not name:
            return  # the apiserver validates the Scale itself
        try:
            refusal = await admission.review_scale(
                rt.cluster, namespace or "default", name, replicas, defaults=defaults
            )
        except KubeError as exc:
            raise kopf.AdmissionError(f"cannot judge the scale now: {exc}", code=503) from exc
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)

    @kopf.on.validate(
        *POLICIES, id="validate-capacitypolicy", operations=["CREATE", "UPDATE"], registry=registry
    )
    async def validate_policy(body: kopf.Body, **_: Any) -> None:
        refusal = admission.review_policy(body)
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)
