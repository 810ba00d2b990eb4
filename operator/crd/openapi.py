"""Small constructors for the OpenAPI v3 subset a structural CRD schema uses."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# Strings the apiserver's CEL cost estimator must see bounded; a Kubernetes name is at most 253.
MAX_NAME_LENGTH = 253
MAX_LABEL_VALUE_LENGTH = 63


def integer(lo: int, hi: int, description: str = "") -> Schema:
    schema: Schema = {"type": "integer", "minimum": lo, "maximum": hi}
    if description:
        schema["description"] = description
    return schema


def number(
    lo: float, hi: float, description: str = "", *, exclusive_minimum: bool = False
) -> Schema:
    schema: Schema = {"type": "number", "minimum": lo, "maximum": hi}
    if exclusive_minimum:
        schema["exclusiveMinimum"] = True
    if description:
        schema["description"] = description
    return schema


def string(max_length: int = MAX_NAME_LENGTH, description: str = "", **extra: Any) -> Schema:
    schema: Schema = {"type": "string", "minLength": 1, "maxLength": max_length, **extra}
    if description:
        schema["description"] = description
    return schema


def enum(values: tuple[str, ...] | list[str], description: str = "") -> Schema:
    schema: Schema = {
        "type": "string",
        "enum": list(values),
        "maxLength": max(len(v) for v in values),
    }
    if description:
        schema["description"] = description
    return schema


def obj(
    properties: dict[str, Schema],
    *,
    required: tuple[str, ...] = (),
    rules: list[dict[str, str]] | None = None,
    description: str = "",
) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if rules:
        schema["x-kubernetes-validations"] = rules
    if description:
        schema["description"] = description
    return schema


def rule(expression: str, message_expression: str = "", message: str = "") -> dict[str, str]:
    """One CEL rule; `messageExpression` is preferred because it can name the numbers."""
    entry = {"rule": expression}
    if message_expression:
        entry["messageExpression"] = message_expression
    if message:
        entry["message"] = message
    return entry


def crd(
    *,
    group: str,
    kind: str,
    plural: str,
    singular: str,
    scope: str,
    version: str,
    schema: Schema,
    printer_columns: list[dict[str, str]],
    short_names: list[str],
    status_subresource: bool,
    scale: dict[str, str] | None = None,
) -> dict[str, Any]:
    served: dict[str, Any] = {
        "name": version,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": printer_columns,
    }
    if status_subresource:
        served["subresources"] = {"status": {}}
    if scale:
        served.setdefault("subresources", {})["scale"] = dict(scale)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
            },
            "versions": [served],
        },
    }


def column(
    name: str, json_path: str, kind: str = "string", description: str = ""
) -> dict[str, str]:
    entry = {"name": name, "type": kind, "jsonPath": json_path}
    if description:
        entry["description"] = description
    return entry
