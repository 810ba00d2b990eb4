"""The ModelPool CRD: the openAPIV3Schema of exactly the fields `parse_modelpool` reads, with the
parser's own bounds, plus the CEL rules of `modelpool_rules`."""

from __future__ import annotations

from typing import Any

from kvbank.model_spec import (
    DTYPE_BYTES,
    KV_DTYPES,
    MAX_CONFIG_MAP_KEY,
    MAX_CONFIG_PATH,
    MAX_WEIGHTS_GIB,
    PRESETS,
)
from kvbank.modelpool import (
    ADMISSION_POLICIES,
    API_GROUP,
    API_VERSION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ESTIMATES,
    KIND,
    MAX_FIXED_TOKENS,
    MAX_LABELS,
    MAX_PAGE_SIZE,
    MAX_PAGES,
    MAX_PREEMPTIONS,
    MAX_REPLICAS,
    MAX_SEQ_LEN,
    MAX_SLOT_MULTIPLIER,
    MAX_SPECULATIVE,
    MAX_TP,
    ORDERS,
    SERVICE_CLASSES,
    VICTIMS,
    Admission,
)
from kvbank.operator.crd import pod_schema
from kvbank.operator.crd.modelpool_rules import (
    architecture_rules,
    from_config_rules,
    root_rules,
    spec_rules,
    structure_rules,
)
from kvbank.operator.crd.modelpool_status import status
from kvbank.operator.crd.openapi import (
    MAX_LABEL_VALUE_LENGTH,
    MAX_NAME_LENGTH,
    Schema,
    column,
    crd,
    enum,
    integer,
    number,
    obj,
    rule,
    string,
)

PLURAL = "modelpools"
# `kubectl scale modelpool NAME --replicas N`, and an HPA or KEDA driving spec.replicas.
SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}


def _from_config() -> Schema:
    return obj(
        {
            "path": string(
                MAX_CONFIG_PATH,
                "a config.json relative to the manifest, for kvbank check and the ranks' "
                "--pool readers (the operator refuses it here; use configMap)",
            ),
            "configMap": obj(
                {
                    "name": string(MAX_NAME_LENGTH, "a ConfigMap in the pool's namespace"),
                    "key": string(
                        MAX_CONFIG_MAP_KEY, "the key holding config.json (default config.json)"
                    ),
                },
                required=("name",),
                description="where the operator reads the model's config.json; an edit of "
                "it is judged again, and the ranks run the copy last accepted",
            ),
            "kvDtype": enum(KV_DTYPES, "the KV cache's dtype (default bfloat16)"),
            "weightsGiB": number(
                0, MAX_WEIGHTS_GIB, "the checkpoint's size, instead of the config's estimate"
            ),
        },
        rules=from_config_rules(),
        description="the model's Hugging Face config.json: its layers become the KV groups",
    )


def _architecture() -> Schema:
    return obj(
        {
            "fromConfig": _from_config(),
            "preset": enum(tuple(sorted(PRESETS)), "a published model shape; fields given win"),
            "layers": integer(1, 1024),
            "attentionHeads": integer(1, 1024),
            "kvHeads": integer(1, 1024),
            "headDim": integer(1, 4096),
            "parameters": number(0, 1e13, "parameter count, for the weights' memory"),
            "dtype": enum(tuple(DTYPE_BYTES)),
        },
        rules=architecture_rules(),
    )


def _kv_slot() -> Schema:
    return obj(
        {
            "prompt": integer(0, MAX_SLOT_MULTIPLIER, "tokens written per prompt token"),
            "output": integer(0, MAX_SLOT_MULTIPLIER, "tokens written per output token"),
            "fixed": integer(0, MAX_FIXED_TOKENS, "tokens written once per request"),
        },
        rules=[
            rule(
                "(has(self.prompt) ? self.prompt : 0) + (has(self.output) ? self.output : 0)"
                " + (has(self.fixed) ? self.fixed : 0) > 0",
                message="writes nothing; set prompt, output or fixed above 0, or drop the label",
            )
        ],
    )


def _best_effort() -> Schema:
    return obj(
        {
            "maxPreemptions": {
                **integer(
                    0,
                    MAX_PREEMPTIONS,
                    "times a best-effort request may be preempted; then it is admitted as "
                    "strict and runs to completion",
                ),
                "default": Admission.max_preemptions,
            },
            "victim": {
                **enum(
                    VICTIMS,
                    "which best-effort request a shortage preempts: the most recently arrived, "
                    "or the one cheapest to rebuild after host reload",
                ),
                "default": Admission.victim.value,
            },
            "estimate": {
                **enum(
                    ESTIMATES,
                    "how a best-effort request's output is estimated at admission: from the "
                    "lengths the pool has seen for its class (learned), or a decaying ratio of "
                    "its budget",
                ),
                "default": Admission.estimate.value,
            },
        },
        description="how best-effort requests (service_tier flex) are preempted",
    )


def _spec() -> Schema:
    kv_slots: Schema = {
        "type": "object",
        "description": "what ONE request writes into each KV label",
        "minProperties": 1,
        "maxProperties": MAX_LABELS,
        "additionalProperties": _kv_slot(),
        "x-kubernetes-validations": [
            rule(
                f"self.all(k, k.size() >= 1 && k.size() <= {MAX_LABEL_VALUE_LENGTH})",
                message=f"a label must be a non-empty string of at most "
                f"{MAX_LABEL_VALUE_LENGTH} characters",
            )
        ],
    }
    return obj(
        {
            "model": obj(
                {
                    "name": string(description="served model name"),
                    "architecture": _architecture(),
                    "source": pod_schema.source(),
                },
                required=("name", "architecture"),
            ),
            "replicas": {**integer(0, MAX_REPLICAS, "tensor-parallel groups"), "default": 1},
            "tensorParallel": {**integer(1, MAX_TP, "ranks (GPUs) per group"), "default": 1},
            "gpu": obj(
                {
                    "memoryGiB": number(0, 4096, exclusive_minimum=True),
                    "memoryUtilization": number(0, 1, exclusive_minimum=True),
                    "reservedGiB": number(0, 4096),
                },
                required=("memoryGiB",),
            ),
            "kv": obj(
                {
                    "pageSize": integer(1, MAX_PAGE_SIZE, "tokens per page"),
                    "pages": integer(2, MAX_PAGES, "pages per rank"),
                    "memoryFraction": number(
                        0, 1, "of the memory weights and reserve leave", exclusive_minimum=True
                    ),
                    "speculativeTokens": integer(0, MAX_SPECULATIVE),
                    "hostPages": integer(
                        0,
                        MAX_PAGES,
                        "pages of host memory per rank keeping evicted prefix pages for reload "
                        "instead of recompute; 0: no host tier",
                    ),
                },
                required=("pageSize",),
                rules=[
                    rule(
                        "!(has(self.pages) && has(self.memoryFraction))",
                        message="set either pages or memoryFraction, not both",
                    ),
                    rule(
                        "has(self.pages) || has(self.memoryFraction)",
                        message="set pages (per rank) or memoryFraction",
                    ),
                ],
            ),
            "kvSlots": kv_slots,
            "limits": obj(
                {
                    "maxSeqLen": integer(2, MAX_SEQ_LEN),
                    "maxTokens": integer(1, MAX_SEQ_LEN),
                    "maxNumBatchedTokens": integer(
                        1,
                        MAX_SEQ_LEN,
                        "the most tokens the engine schedules in one step (default "
                        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}); a window or chunk holds two steps",
                    ),
                },
                required=("maxSeqLen", "maxTokens"),
                rules=[
                    rule(
                        "self.maxTokens < self.maxSeqLen",
                        message_expression="'maxTokens must be below maxSeqLen (%d) so a "
                        "prompt fits, got %d'.format([self.maxSeqLen, self.maxTokens])",
                    )
                ],
            ),
            "admission": obj(
                {
                    "minConcurrency": integer(0, MAX_PAGES, "worst-case requests held at once"),
                    "policy": {**enum(ADMISSION_POLICIES), "default": Admission.policy},
                    "backfill": {"type": "boolean", "default": Admission.backfill},
                    "defaultClass": {
                        **enum(
                            SERVICE_CLASSES,
                            "the class of a request whose service_tier is auto, default or "
                            "absent: strict (never preempted) or best-effort",
                        ),
                        "default": Admission.default_class.value,
                    },
                    "bestEffort": _best_effort(),
                    "order": {
                        **enum(
                            ORDERS,
                            "the order waiting strict requests meet the ledger in under "
                            "spec.engine.kind vllm: fifo (arrival) or prefix (those whose prompt "
                            "starts with a prefix a running request holds first)",
                        ),
                        "default": Admission.order,
                    },
                }
            ),
            "template": pod_schema.template(),
            "engine": pod_schema.engine(),
            "apiKeySecret": pod_schema.api_key_secret(),
            "routing": pod_schema.routing(),
        },
        required=("model", "gpu", "kv", "limits"),
        rules=structure_rules() + spec_rules(),
    )


def modelpool_crd() -> dict[str, Any]:
    schema = obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec(),
            "status": status(),
        },
        required=("spec",),
        rules=root_rules(),
        description="A model served by tensor-parallel groups whose KV pool must hold what the "
        "spec promises.",
    )
    return crd(
        group=API_GROUP,
        kind=KIND,
        plural=PLURAL,
        singular="modelpool",
        scope="Namespaced",
        version=API_VERSION,
        schema=schema,
        short_names=["mp"],
        status_subresource=True,
        scale=SCALE,
        printer_columns=[
            column("Model", ".spec.model.name"),
            column("Replicas", ".spec.replicas", "integer"),
            column("TP", ".spec.tensorParallel", "integer"),
            column("Pages", ".status.pages", "integer", "KV pages per rank"),
            column("Worst-Case", ".status.worstConcurrency", "integer", "worst-case requests held"),
            column("Ready", ".status.readyReplicas", "integer", "groups with every rank ready"),
            column("Accepted", '.status.conditions[?(@.type=="Accepted")].status'),
            column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )
