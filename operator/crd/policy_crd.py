"""The CapacityPolicy CRD (cluster-scoped), bounded the way `kvbank.operator.policy` parses it."""

from __future__ import annotations

from typing import Any

from kvbank.modelpool import API_GROUP, API_VERSION, MAX_PAGE_SIZE, MAX_PAGES, MAX_SEQ_LEN
from kvbank.operator.crd.openapi import (
    MAX_LABEL_VALUE_LENGTH,
    Schema,
    column,
    crd,
    enum,
    integer,
    obj,
    rule,
    string,
)
from kvbank.operator.policy import (
    MAX_GPUS,
    MAX_PAGE_SIZES,
    MAX_SELECTOR_TERMS,
    MAX_SELECTOR_VALUES,
    OPERATORS,
    POLICY_KIND,
)

PLURAL = "capacitypolicies"
MAX_MATCH_LABELS = 32
LABEL_KEY_LENGTH = 317  # a prefix of up to 253, a slash and a name of up to 63


def _selector() -> Schema:
    requirement = obj(
        {
            "key": string(LABEL_KEY_LENGTH),
            "operator": enum(OPERATORS),
            "values": {
                "type": "array",
                "maxItems": MAX_SELECTOR_VALUES,
                "items": {"type": "string", "maxLength": MAX_LABEL_VALUE_LENGTH},
            },
        },
        required=("key", "operator"),
        rules=[
            rule(
                "!(self.operator in ['In', 'NotIn']) "
                "|| (has(self.values) && size(self.values) > 0)",
                message="values must not be empty with operator In or NotIn",
            ),
            rule(
                "self.operator in ['In', 'NotIn'] || !has(self.values) || size(self.values) == 0",
                message="values must be empty with operator Exists or DoesNotExist",
            ),
        ],
    )
    return obj(
        {
            "matchLabels": {
                "type": "object",
                "maxProperties": MAX_MATCH_LABELS,
                "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE_LENGTH},
            },
            "matchExpressions": {
                "type": "array",
                "maxItems": MAX_SELECTOR_TERMS,
                "items": requirement,
            },
        },
        description="namespaces the limits apply to; {} selects every namespace, none selects none",
    )


def capacity_policy_crd() -> dict[str, Any]:
    limits = obj(
        {
            "gpusPerNamespace": integer(
                0, MAX_GPUS, "sum over the namespace's pools of replicas x tensorParallel"
            ),
            "pagesPerPool": integer(2, MAX_PAGES, "largest KV pool, pages per rank"),
            "maxTokens": integer(1, MAX_SEQ_LEN, "largest limits.maxTokens"),
            "maxSeqLen": integer(2, MAX_SEQ_LEN, "largest limits.maxSeqLen"),
            "allowedPageSizes": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_PAGE_SIZES,
                "items": integer(1, MAX_PAGE_SIZE),
                "x-kubernetes-list-type": "set",
            },
            "minConcurrency": integer(0, MAX_PAGES, "a floor on admission.minConcurrency"),
        }
    )
    schema = obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": obj({"namespaceSelector": _selector(), "limits": limits}, required=("limits",)),
        },
        required=("spec",),
        description="A platform team's KV capacity limits for the namespaces it selects; every "
        "matching policy applies, so the most restrictive limit wins.",
    )
    return crd(
        group=API_GROUP,
        kind=POLICY_KIND,
        plural=PLURAL,
        singular="capacitypolicy",
        scope="Cluster",
        version=API_VERSION,
        schema=schema,
        short_names=["kvcp"],
        status_subresource=False,
        printer_columns=[
            column("GPUs/Namespace", ".spec.limits.gpusPerNamespace", "integer"),
            column("Pages/Pool", ".spec.limits.pagesPerPool", "integer"),
            column("Max-Tokens", ".spec.limits.maxTokens", "integer"),
            column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )
