"""The CRDs: generated YAML is current, structurally sound and bounded, its CEL compiles, and
the schema accepts exactly what `parse_modelpool` accepts — with CEL's capacity rules agreeing
with `holdability` wherever CEL states them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validate import compile_rule, validate, walk_schemas
from hypothesis import HealthCheck, given, settings
from operator_specs import policy_doc, pool_doc
from operator_strategies import SPEC, VALID_SPEC, spec_doc

from kvbank.capacity import holdability
from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.crd import generate
from kvbank.operator.crd.modelpool_crd import modelpool_crd
from kvbank.operator.crd.modelpool_rules import spec_rules
from kvbank.operator.crd.policy_crd import capacity_policy_crd
from kvbank.operator.policy import parse_capacity_policy

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "kvbank" / "crds"
POOL_SCHEMA = modelpool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
POLICY_SCHEMA = capacity_policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CAPACITY_RULES = frozenset(r["rule"] for r in spec_rules())


def _stored(name: str) -> dict[str, Any]:
    return yaml.safe_load((CRDS / name).read_text())


class TestGeneratedFiles:
    def test_committed_yaml_is_what_the_builders_produce(self) -> None:
        assert generate.main(["--check", str(CRDS)]) == 0

    def test_check_notices_a_stale_file(self, tmp_path: Path) -> None:
        generate.main([str(tmp_path)])
        path = tmp_path / "modelpools.kvbank.dev.yaml"
        path.write_text(path.read_text().replace("maxItems: 8", "maxItems: 9"))
        assert generate.main(["--check", str(tmp_path)]) == 1

    def test_yaml_round_trips_to_the_builders(self) -> None:
        assert _stored("modelpools.kvbank.dev.yaml") == modelpool_crd()
        assert _stored("capacitypolicies.kvbank.dev.yaml") == capacity_policy_crd()


@pytest.mark.parametrize("crd", [modelpool_crd(), capacity_policy_crd()], ids=["pool", "policy"])
class TestStructure:
    def test_apiextensions_v1_shape(self, crd: dict[str, Any]) -> None:
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
        (version,) = spec["versions"]
        assert version["served"] and version["storage"]
        assert version["schema"]["openAPIV3Schema"]["type"] == "object"

    def test_every_node_is_typed_and_bounded(self, crd: dict[str, Any]) -> None:
        """Structural schema, and bounds for CEL's cost estimate: every string has maxLength
        (or an enum), every array maxItems, every map maxProperties."""
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk_schemas(schema):
            assert "type" in node or node.get("x-kubernetes-int-or-string"), path
            assert not ("properties" in node and "additionalProperties" in node), path
            if node.get("type") == "string" and path not in (".apiVersion", ".kind"):
                assert "maxLength" in node or "enum" in node or "format" in node, path
            if node.get("type") == "array":
                assert "maxItems" in node, path
            if isinstance(node.get("additionalProperties"), dict):
                assert "maxProperties" in node, path

    def test_every_cel_expression_compiles(self, crd: dict[str, Any]) -> None:
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        count = 0
        for _, node in walk_schemas(schema):
            for entry in node.get("x-kubernetes-validations", []):
                compile_rule(entry["rule"])
                if "messageExpression" in entry:
                    compile_rule(entry["messageExpression"])
                    # kube-apiserver estimates string(x) as unbounded and refuses the CRD for
                    # its cost; format() with %d is estimated from its arguments' bounds.
                    assert "string(" not in entry["messageExpression"], entry
                assert "messageExpression" in entry or "message" in entry
                count += 1
        assert count > 0


class TestModelPoolCRD:
    def test_status_subresource_and_printer_columns(self) -> None:
        version = modelpool_crd()["spec"]["versions"][0]
        assert version["subresources"] == {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        }
        columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
        assert columns == {
            "Model": ".spec.model.name",
            "Replicas": ".spec.replicas",
            "TP": ".spec.tensorParallel",
            "Pages": ".status.pages",
            "Worst-Case": ".status.worstConcurrency",
            "Ready": ".status.readyReplicas",
            "Accepted": '.status.conditions[?(@.type=="Accepted")].status',
            "Age": ".metadata.creationTimestamp",
        }

    def test_examples_validate_as_kvbank_check_judges_them(self) -> None:
        good = yaml.safe_load((ROOT / "examples" / "modelpool-llama-8b.yaml").read_text())
        good["spec"]["model"]["architecture"]["parameters"] = 8.03e9  # YAML 1.1 reads a str
        assert validate(POOL_SCHEMA, good) == []
        bad = yaml.safe_load((ROOT / "examples" / "modelpool-unholdable.yaml").read_text())
        (error,) = validate(POOL_SCHEMA, bad)
        assert "kv.pages=400 cannot hold one worst-case request (513 pages" in error
        assert "Raise kv.pages to at least 514" in error

    def test_cel_message_names_the_numbers(self) -> None:
        doc = pool_doc(tensorParallel=3)
        errors = validate(POOL_SCHEMA, doc)
        assert (
            ".spec: tensorParallel=3 does not divide model.architecture.attentionHeads=32. "
            "Use a tensorParallel that divides it." in errors
        )

    def test_long_names_are_refused(self) -> None:
        errors = validate(POOL_SCHEMA, pool_doc(name="x" * 41))
        assert errors == [
            ": metadata.name must be at most 40 characters (its pods, Services and revision "
            "hashes add suffixes within 63), got 41"
        ]

    def test_worst_case_products_stay_inside_int64(self) -> None:
        """The largest numbers the schema allows evaluate without overflow."""
        doc = pool_doc(
            kv={"pageSize": 1, "pages": 1 << 24, "speculativeTokens": 64},
            kvSlots={"main": {"prompt": 64, "output": 64, "fixed": 1 << 22}},
            limits={"maxSeqLen": 1 << 22, "maxTokens": (1 << 22) - 1},
            admission={"minConcurrency": 1 << 24},
        )
        errors = validate(POOL_SCHEMA, doc)
        assert errors and all("rule error" not in e for e in errors)


def _oss(**changes: Any) -> dict[str, Any]:
    """A pool whose model is read from a ConfigMap's config.json, with `changes` applied as
    (dotted spec path -> value; None deletes)."""
    doc = pool_doc(
        "oss",
        model={"name": "gpt-oss-20b", "architecture": {"fromConfig": {"configMap": {"name": "c"}}}},
        limits={"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
    )
    del doc["spec"]["kvSlots"]
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = doc["spec"]
        for key in parents:
            node = node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return doc


ARCH = "model.architecture"


class TestFromConfig:
    def test_a_config_map_pool_validates_and_parses(self) -> None:
        for doc in (
            _oss(),
            _oss(**{f"{ARCH}.fromConfig": {"path": "c.json", "kvDtype": "fp8", "weightsGiB": 13}}),
            _oss(**{f"{ARCH}.fromConfig.configMap": {"name": "c", "key": "oss.json"}}),
        ):
            assert validate(POOL_SCHEMA, doc) == []
            parse_modelpool(doc)

    @pytest.mark.parametrize(
        ("changes", "words"),
        [
            ({"kvSlots": {"main": {"prompt": 1, "output": 1}}}, "drop kvSlots"),
            ({f"{ARCH}.fromConfig": None, f"{ARCH}.preset": "qwen3-8b"}, "kvSlots is required"),
            ({f"{ARCH}.layers": 3}, "fromConfig describes the model by itself"),
            ({f"{ARCH}.fromConfig": {}}, "give exactly one of path"),
            ({f"{ARCH}.fromConfig.path": "c.json"}, "give exactly one of path"),
            ({f"{ARCH}.fromConfig.kvDtype": "int3"}, "kvDtype"),
            ({f"{ARCH}.fromConfig.weightsGiB": -1}, "weightsGiB"),
            ({f"{ARCH}.fromConfig.configMap": {"key": "k"}}, "name"),
            ({f"{ARCH}.fromConfig.size": 7}, "size"),
            ({"limits.maxNumBatchedTokens": 0}, "maxNumBatchedTokens"),
            ({"limits.maxNumBatchedTokens": (1 << 22) + 1}, "maxNumBatchedTokens"),
        ],
    )
    def test_the_schema_refuses_what_the_parser_refuses(
        self, changes: dict[str, Any], words: str
    ) -> None:
        doc = _oss(**changes)
        errors = validate(POOL_SCHEMA, doc)
        assert errors and any(words in e for e in errors), errors
        assert not _parses(doc)


class TestCapacityPolicyCRD:
    def test_selector_rules(self) -> None:
        bad = policy_doc(
            "p", {"maxTokens": 10}, {"matchExpressions": [{"key": "team", "operator": "In"}]}
        )
        assert validate(POLICY_SCHEMA, bad) == [
            ".spec.namespaceSelector.matchExpressions[0]: values must not be empty with "
            "operator In or NotIn"
        ]
        good = policy_doc("p", {"gpusPerNamespace": 8, "allowedPageSizes": [16, 32]}, {})
        assert validate(POLICY_SCHEMA, good) == []
        parse_capacity_policy(good)

    def test_scope_and_no_status(self) -> None:
        crd = capacity_policy_crd()
        assert crd["spec"]["scope"] == "Cluster"
        assert "subresources" not in crd["spec"]["versions"][0]


# ---- schema == parser, by hypothesis -------------------------------------------------------


def _parses(doc: dict[str, Any]) -> bool:
    try:
        parse_modelpool(copy.deepcopy(doc))
    except SpecError:
        return False
    return True


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPEC)
def test_schema_accepts_exactly_what_the_parser_accepts(spec: dict[str, Any]) -> None:
    doc = spec_doc(spec)
    errors = validate(POOL_SCHEMA, doc, skip_rules=CAPACITY_RULES)
    assert (errors == []) == _parses(doc), errors


def _kinds(violations: tuple[str, ...]) -> set[str]:
    kinds = set()
    for v in violations:
        if v.startswith("kv.pages=") and "worst-case request" in v:
            kinds.add("worst")
        elif v.startswith("admission.minConcurrency="):
            kinds.add("concurrency")
        elif v.startswith("tensorParallel="):
            kinds.add("heads-split" if "does not divide" in v else "kv-split")
    return kinds


def _cel_kinds(errors: list[str]) -> set[str]:
    return _kinds(tuple(e.removeprefix(".spec: ") for e in errors))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALID_SPEC)
def test_cel_capacity_rules_agree_with_holdability(spec: dict[str, Any]) -> None:
    doc = spec_doc(spec)
    held = holdability(parse_modelpool(copy.deepcopy(doc)))
    expected = _kinds(held.violations)
    if len(spec["kvSlots"]) != 1:  # several labels: the worst case is the webhook's
        expected -= {"worst", "concurrency"}
    assert _cel_kinds(validate(POOL_SCHEMA, doc)) == expected
