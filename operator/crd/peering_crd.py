"""The two kinds kopf's peering keeps its replicas' liveness in (`kopf.dev/v1`): a
ClusterKopfPeering for an operator that watches every namespace, a KopfPeering in each
namespace of one that watches a list. kopf writes each replica's identity, priority and
expiry under the object's `status` by a patch of the object itself, so `status` is a plain
field here (a status subresource would make kopf's patch drop it) with whatever keys kopf
writes, and nothing else is stored."""

from __future__ import annotations

from typing import Any

PEERING_GROUP = "kopf.dev"


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{PEERING_GROUP}"},
        "spec": {
            "group": PEERING_GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "the operator replicas alive, by kopf's peering",
                            "properties": {
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def cluster_peering_crd() -> dict[str, Any]:
    return _peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster")


def namespaced_peering_crd() -> dict[str, Any]:
    return _peering_crd("KopfPeering", "kopfpeerings", "Namespaced")
