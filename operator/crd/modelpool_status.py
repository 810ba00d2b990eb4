"""The ModelPool's status schema: what the operator writes back (the pool's pages and worst case,
its groups, its conditions, the sidecars' live figures), bounded as the operator writes it."""

from __future__ import annotations

from kvbank.capacity.configfile import MAX_LAYERS
from kvbank.capacity.modellayout import Kind
from kvbank.operator.crd.openapi import MAX_LABEL_VALUE_LENGTH, Schema, enum, obj, string

MAX_CONDITIONS = 8
MAX_MESSAGE_LENGTH = 32768


def _condition() -> Schema:
    return obj(
        {
            "type": string(64),
            "status": enum(("True", "False", "Unknown")),
            "reason": string(128),
            "message": {"type": "string", "maxLength": MAX_MESSAGE_LENGTH},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "minimum": 0},
        },
        required=("type", "status"),
    )


def status() -> Schema:
    count = {"type": "integer", "minimum": 0}
    live = obj(
        {
            "pagesTotal": count,
            "freePages": count,
            "evictablePages": count,
            "reservedPages": count,
            "outstandingPages": count,
            "queueDepth": count,
            "sidecarsReporting": count,
            "sidecarsExpected": count,
            "updatedAt": {"type": "string", "format": "date-time"},
        },
        description="summed over the replicas' rank-0 sidecars at updatedAt",
    )
    return obj(
        {
            "observedGeneration": count,
            "replicas": count,
            "readyReplicas": count,
            "pages": count,
            "worstRequestPages": count,
            "worstConcurrency": count,
            "workload": enum(("StatefulSet", "LeaderWorkerSet")),
            "configHash": string(64),
            "selector": {
                "type": "string",
                "maxLength": 1024,
                "description": "the rank pods' label selector (the scale subresource's)",
            },
            "sidecarTLS": obj(
                {
                    "secret": string(),
                    "serial": string(64),
                    "notAfter": {"type": "string", "format": "date-time"},
                    "names": string(64),
                    "ca": string(64),
                },
                description="the sidecar certificate issued into the Secret, renewed before "
                "notAfter",
            ),
            "conditions": {
                "type": "array",
                "maxItems": MAX_CONDITIONS,
                "items": _condition(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "live": live,
            "groups": {
                "type": "array",
                "maxItems": MAX_LAYERS,
                "items": _group(),
                "description": "a fromConfig pool's KV groups, as its config.json lays them out",
            },
        }
    )


def _group() -> Schema:
    count = {"type": "integer", "minimum": 0}
    return obj(
        {
            "name": string(MAX_LABEL_VALUE_LENGTH, "the group's KV label"),
            "kind": enum(tuple(k.value for k in Kind)),
            "layers": count,
            "pageBytes": {**count, "description": "bytes of one page, every layer it spans"},
            "rule": string(256, "what one request holds here at most"),
            "worstRequestPages": {**count, "description": "the worst-case request's pages here"},
        }
    )
