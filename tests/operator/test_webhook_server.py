"""The webhook as the apiserver reaches it: kopf's HTTPS server on loopback, with the
certificate the operator issued itself and the CA bundle it patched into the webhook
configuration, answering AdmissionReviews on the handler-id paths the chart routes to."""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import socket
import ssl
from typing import Any

import aiohttp
import kopf
from kopf._cogs.structs import references
from kopf._core.engines import admission as kopf_admission
from kopf._core.engines.indexing import OperatorIndexers
from kopf._core.reactor.inventory import ResourceMemories
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, pool_doc

from kvbank.operator import config as operator_config
from kvbank.operator.handlers import Runtime, register
from kvbank.operator.webhook_tls import ServerTLS

ROUND_TRIPS: Any = None  # set by bench_webhook.py

POOLS = references.Resource(
    group="kvbank.dev", version="v1alpha1", plural="modelpools", kind="ModelPool", namespaced=True
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _review(uid: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "kvbank.dev", "version": "v1alpha1", "kind": "ModelPool"},
            "resource": {"group": "kvbank.dev", "version": "v1alpha1", "resource": "modelpools"},
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
        },
    }


async def _serve_and_ask(port: int) -> list[dict[str, Any]]:
    cluster = FakeCluster()
    cluster.put(namespace_doc("team-a"))
    cluster.put(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "kvbank"},
            "webhooks": [{"name": "modelpools.kvbank.dev", "clientConfig": {}}],
        }
    )
    parser = argparse.ArgumentParser()
    operator_config.add_arguments(parser)
    flags = ["--webhook-listen", "127.0.0.1", "--webhook-port", str(port)]
    flags += ["--webhook-configuration", "kvbank", "--webhook-extra-san", "127.0.0.1"]
    config = operator_config.OperatorConfig.from_args(parser.parse_args(flags))
    runtime = Runtime(config=config, cluster=cluster, source=None, tls=ServerTLS())  # type: ignore[arg-type]
    # cleanup (below) closes it, removing the key
    registry = kopf.OperatorRegistry()
    register(registry, runtime)
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    startup = next(
        h.fn for h in registry._activities.get_all_handlers() if h.fn.__name__ == "startup"
    )
    cleanup = next(
        h.fn for h in registry._activities.get_all_handlers() if h.fn.__name__ == "cleanup"
    )
    await startup(settings=settings, memo=memo)

    insights = references.Insights()
    insights.webhook_resources.add(POOLS)
    webhookfn = functools.partial(
        kopf_admission.serve_admission_request,
        settings=settings,
        registry=registry,
        insights=insights,
        memories=ResourceMemories(),
        memobase=kopf.Memo(),
        indices=OperatorIndexers().indices,
    )
    hook = cluster.one("ValidatingWebhookConfiguration", "kvbank")["webhooks"][0]
    trusted = ssl.create_default_context(
        cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    )
    answers = []
    server = settings.admission.server(webhookfn)
    try:
        await server.__anext__()  # listening
        async with aiohttp.ClientSession() as session:
            if ROUND_TRIPS is not None:  # bench_webhook.py times many reviews here
                await ROUND_TRIPS(session, f"https://127.0.0.1:{port}/validate-modelpool", trusted)
            for uid, obj in (
                ("bad", pool_doc(kv={"pageSize": 16, "pages": 400, "speculativeTokens": 1})),
                ("good", pool_doc()),
            ):
                async with session.post(
                    f"https://127.0.0.1:{port}/validate-modelpool",
                    json=_review(uid, obj),
                    ssl=trusted,
                ) as response:
                    assert response.status == 200
                    answers.append(await response.json())
    finally:
        await server.aclose()
        await cleanup(memo=memo)
    return answers


def test_admission_reviews_over_tls_with_the_operators_own_ca() -> None:
    bad, good = asyncio.run(asyncio.wait_for(_serve_and_ask(_free_port()), 30))
    assert bad["response"]["uid"] == "bad"
    assert bad["response"]["allowed"] is False
    assert bad["response"]["status"]["code"] == 422
    assert bad["response"]["status"]["message"] == (
        "ModelPool team-a/llama: 1 violation(s):\n"
        "  - kv.pages=400 cannot hold one worst-case request (513 pages: maxSeqLen 8192 + 1 "
        "speculative token at pageSize 16). Raise kv.pages to at least 514, or lower "
        "limits.maxSeqLen to at most 6383."
    )
    assert good["response"] == {"uid": "good", "allowed": True}
