"""The schema of the ModelPool's pod-facing fields (`kvbank.deployment` reads them):
`spec.model.source`, `spec.template`, `spec.engine` and `spec.apiKeySecret`, with CEL rules
for what the schema alone cannot say (exactly one source; no engine flag the operator sets).

What Kubernetes defines at length (an affinity's terms, a spread constraint's label selector)
is kept as given (`x-kubernetes-preserve-unknown-fields`) and judged by the apiserver when the
StatefulSet is applied: copying those schemas here would only let them drift from the real ones.
"""

from __future__ import annotations

from kvbank.deployment import (
    AFFINITY_KINDS,
    APPARMOR_TYPES,
    DEFAULT_API_KEY,
    DEFAULT_IMAGE_PATH,
    ENGINE_KINDS,
    MAX_ARG_LENGTH,
    MAX_ENGINE_ARGS,
    MAX_GPUS_PER_RANK,
    MAX_ITEMS,
    PICKERS,
    QUANTITY,
    RENDERED_FLAGS,
    SELINUX_TYPES,
    SOURCE_KINDS,
    TAINT_EFFECTS,
    TOLERATION_OPERATORS,
    WHEN_UNSATISFIABLE,
)
from kvbank.operator.crd.openapi import MAX_NAME_LENGTH, Schema, enum, integer, obj, rule, string

PRESERVED: Schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def quantity(description: str) -> Schema:
    """Kubernetes' own shape for a quantity: `8`, `500m` and `16Gi` alike."""
    return {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY.pattern,
        "description": description,
    }


def _path(description: str) -> Schema:
    return string(4096, description)


def _secret_key(default_key: str) -> Schema:
    return obj(
        {
            "name": string(MAX_NAME_LENGTH),
            "key": {**string(MAX_NAME_LENGTH), "default": default_key},
        },
        required=("name",),
    )


def source() -> Schema:
    one = " + ".join(f"(has(self.{kind}) ? 1 : 0)" for kind in SOURCE_KINDS)
    return obj(
        {
            "pvc": obj(
                {
                    "claimName": string(MAX_NAME_LENGTH),
                    "subPath": _path("the model folder inside the claim"),
                },
                required=("claimName",),
            ),
            "hostPath": obj(
                {"path": _path("a folder on every node (development only)")}, required=("path",)
            ),
            "image": obj(
                {
                    "reference": string(512, "an image holding the model folder"),
                    "path": {
                        **_path("the model folder inside the image"),
                        "default": DEFAULT_IMAGE_PATH,
                    },
                },
                required=("reference",),
            ),
            "huggingFace": obj(
                {
                    "repo": string(200, "e.g. meta-llama/Llama-3.1-8B-Instruct"),
                    "revision": string(255),
                    "tokenSecret": _secret_key("token"),
                },
                required=("repo",),
            ),
        },
        rules=[
            rule(
                f"{one} == 1",
                message="set exactly one of " + ", ".join(SOURCE_KINDS),
            )
        ],
        description="where the weights come from; mounted read-only where --model looks",
    )


def template() -> Schema:
    toleration = obj(
        {
            "key": string(317),
            "operator": enum(TOLERATION_OPERATORS),
            "value": {"type": "string", "maxLength": 63},
            "effect": enum(TAINT_EFFECTS),
            "tolerationSeconds": integer(0, 1 << 31),
        }
    )
    spread = obj(
        {
            "maxSkew": integer(1, 1 << 20),
            "topologyKey": string(317),
            "whenUnsatisfiable": enum(WHEN_UNSATISFIABLE),
            "labelSelector": {**PRESERVED, "description": "default: the pool's own pods"},
            "minDomains": integer(1, 1 << 20),
            "nodeAffinityPolicy": enum(("Honor", "Ignore")),
            "nodeTaintsPolicy": enum(("Honor", "Ignore")),
            "matchLabelKeys": {
                "type": "array",
                "maxItems": MAX_ITEMS,
                "items": {"type": "string", "maxLength": 317},
            },
        },
        required=("maxSkew", "topologyKey", "whenUnsatisfiable"),
    )
    return obj(
        {
            "nodeSelector": {
                "type": "object",
                "maxProperties": 64,
                "additionalProperties": {"type": "string", "maxLength": 63},
            },
            "tolerations": {"type": "array", "maxItems": MAX_ITEMS, "items": toleration},
            "affinity": obj({kind: PRESERVED for kind in sorted(AFFINITY_KINDS)}),
            "topologySpreadConstraints": {"type": "array", "maxItems": 8, "items": spread},
            "priorityClassName": string(MAX_NAME_LENGTH),
            "runtimeClassName": string(MAX_NAME_LENGTH),
            "imagePullSecrets": {
                "type": "array",
                "maxItems": MAX_ITEMS,
                "items": obj({"name": string(MAX_NAME_LENGTH)}, required=("name",)),
            },
            "resources": obj(
                {
                    "gpusPerRank": integer(0, MAX_GPUS_PER_RANK, "default 1"),
                    "cpu": quantity("CPU request of the engine container"),
                    "memory": quantity("memory request and limit of the engine container"),
                }
            ),
            "shmSize": quantity("an in-memory emptyDir at /dev/shm"),
            "securityContext": obj(
                {
                    "supplementalGroups": {
                        "type": "array",
                        "maxItems": MAX_ITEMS,
                        "items": integer(1, (1 << 31) - 1),
                    },
                    "seLinuxOptions": obj(
                        {"type": enum(SELINUX_TYPES), "level": string(MAX_NAME_LENGTH)}
                    ),
                    "appArmorProfile": obj(
                        {
                            "type": enum(APPARMOR_TYPES),
                            "localhostProfile": string(MAX_NAME_LENGTH),
                        },
                        required=("type",),
                    ),
                },
                description="added to the operator's hardened pod security context, which "
                "no pool can change",
            ),
        },
        description="where the rank pods run and what they ask of their nodes; unset fields "
        "take the chart's pools.template",
    )


def _no_rendered_flags(kind: str) -> dict[str, str]:
    flags = "|".join(f.removeprefix("--") for f in RENDERED_FLAGS[kind])
    return rule(
        f"self.kind != '{kind}' || !has(self.args) || "
        f"self.args.all(a, !a.matches('^--({flags})(=.*)?$'))",
        message=f"spec.engine.args sets a flag the operator renders for {kind} from the spec "
        f"({', '.join(RENDERED_FLAGS[kind])}); drop it and set kv, limits, admission or "
        "apiKeySecret instead",
    )


def engine() -> Schema:
    return obj(
        {
            "kind": {**enum(ENGINE_KINDS), "default": "kvbank"},
            "image": string(512, "default: the chart's engine image for the kind"),
            "args": {
                "type": "array",
                "maxItems": MAX_ENGINE_ARGS,
                "items": {"type": "string", "maxLength": MAX_ARG_LENGTH},
                "description": "more flags for the engine's command line",
            },
        },
        rules=[_no_rendered_flags(kind) for kind in ENGINE_KINDS],
    )


def api_key_secret() -> Schema:
    return {
        **_secret_key(DEFAULT_API_KEY),
        "description": "a Secret of this namespace whose key holds the API keys, one a line",
    }


def routing() -> Schema:
    return obj(
        {
            "picker": {
                **enum(
                    PICKERS,
                    "kvbank: an InferencePool over the pool's rank-0 pods and `kvbank picker` as "
                    "its endpoint picker (docs/routing.md); none: the traffic Service alone",
                ),
                "default": "none",
            }
        }
    )
