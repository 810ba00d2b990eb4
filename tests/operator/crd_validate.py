"""A validator for the subset of OpenAPI v3 our CRDs use, with their CEL rules evaluated by
cel-python — the apiserver's checks, offline, close enough to compare the schema with the
parser. Unknown fields are errors, as under kubectl's default strict field validation."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import celpy


def _format(template: Any, values: Any) -> Any:
    """Kubernetes' CEL string extension `'%d ...'.format([...])`, which cel-python lacks."""
    return celpy.celtypes.StringType(
        str(template) % tuple(int(v) if isinstance(v, int) else str(v) for v in values)
    )


@cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression), functions={"format": _format})


def compile_rule(expression: str) -> None:
    _program(expression)


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _evaluate(expression: str, value: Any) -> Any:
    return _program(expression).evaluate({"self": celpy.json_to_cel(value)})


class Validator:
    def __init__(self, skip_rules: frozenset[str] = frozenset()) -> None:
        self.skip_rules = skip_rules
        self.errors: list[str] = []
        self._rules: list[tuple[str, dict[str, str], Any]] = []

    def validate(self, schema: dict[str, Any], value: Any) -> list[str]:
        self._walk(schema, value, "")
        if not self.errors:  # as the apiserver: rules run on a schema-valid object
            for path, entry, node in self._rules:
                self._run_rule(path, entry, node)
        return self.errors

    def _run_rule(self, path: str, entry: dict[str, str], node: Any) -> None:
        try:
            ok = bool(_evaluate(entry["rule"], node))
        except Exception as exc:  # an evaluation error rejects, as in the apiserver
            self.errors.append(f"{path}: rule error {exc}")
            return
        if ok:
            return
        if "messageExpression" in entry:
            text = str(_evaluate(entry["messageExpression"], node))
        else:
            text = entry.get("message", entry["rule"])
        self.errors.append(f"{path}: {text}")

    def _walk(self, schema: dict[str, Any], value: Any, path: str) -> Any:
        kind = schema.get("type")
        fail = self.errors.append
        if kind == "object":
            if not isinstance(value, dict):
                fail(f"{path}: must be an object")
                return value
            value = dict(value)
            props = schema.get("properties")
            extra = schema.get("additionalProperties")
            for key, sub in (props or {}).items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
            for key in schema.get("required", []):
                if key not in value:
                    fail(f"{path}.{key}: Required value")
            if props is not None:
                for key in list(value):
                    if key in props:
                        value[key] = self._walk(props[key], value[key], f"{path}.{key}")
                    else:
                        fail(f"{path}.{key}: unknown field")
            elif isinstance(extra, dict):
                for key in list(value):
                    value[key] = self._walk(extra, value[key], f"{path}.{key}")
            if "minProperties" in schema and len(value) < schema["minProperties"]:
                fail(f"{path}: fewer than {schema['minProperties']} properties")
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                fail(f"{path}: more than {schema['maxProperties']} properties")
        elif kind == "array":
            if not isinstance(value, list):
                fail(f"{path}: must be an array")
                return value
            if len(value) > schema.get("maxItems", len(value)):
                fail(f"{path}: too many items")
            if len(value) < schema.get("minItems", 0):
                fail(f"{path}: too few items")
            value = [self._walk(schema["items"], v, f"{path}[{i}]") for i, v in enumerate(value)]
        elif kind == "string":
            if not isinstance(value, str):
                fail(f"{path}: must be a string")
                return value
            if len(value) < schema.get("minLength", 0) or len(value) > schema.get(
                "maxLength", len(value)
            ):
                fail(f"{path}: bad length {len(value)}")
            if "enum" in schema and value not in schema["enum"]:
                fail(f"{path}: not one of {schema['enum']}")
        elif kind == "integer":
            if not _is_int(value):
                fail(f"{path}: must be an integer")
                return value
            value = int(value)
            self._bounds(schema, value, path)
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(f"{path}: must be a number")
                return value
            self._bounds(schema, value, path)
        elif kind == "boolean" and not isinstance(value, bool):
            fail(f"{path}: must be a boolean")
        for entry in schema.get("x-kubernetes-validations", []):
            if entry["rule"] not in self.skip_rules:
                self._rules.append((path, entry, value))
        return value

    def _bounds(self, schema: dict[str, Any], value: float, path: str) -> None:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and (value < lo or (schema.get("exclusiveMinimum") and value == lo)):
            self.errors.append(f"{path}: below minimum {lo}")
        if hi is not None and value > hi:
            self.errors.append(f"{path}: above maximum {hi}")


def validate(schema: dict[str, Any], value: Any, skip_rules: frozenset[str] = frozenset()):
    return Validator(skip_rules).validate(schema, value)


def walk_schemas(schema: dict[str, Any], path: str = ""):
    """(path, node) for every schema node."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk_schemas(sub, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk_schemas(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        yield from walk_schemas(schema["items"], f"{path}[]")
