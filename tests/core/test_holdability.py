"""The ModelPool schema and the holdability rules, each violation with numbers and a fix."""

import copy

import pytest
import yaml

from kvbank.capacity import holdability, page_bytes, pool_pages
from kvbank.modelpool import SpecError, parse_modelpool

BASE = yaml.safe_load(
    """
apiVersion: kvbank.dev/v1alpha1
kind: ModelPool
metadata: {name: llama-8b, namespace: team-a}
spec:
  model:
    name: llama-3.1-8b-instruct
    architecture: {layers: 32, attentionHeads: 32, kvHeads: 8, headDim: 128,
                   parameters: 8030000000, dtype: bfloat16}
  replicas: 2
  tensorParallel: 1
  gpu: {memoryGiB: 80, memoryUtilization: 0.9, reservedGiB: 2}
  kv: {pageSize: 16, pages: 20000, speculativeTokens: 1}
  kvSlots:
    main: {prompt: 1, output: 1}
  limits: {maxSeqLen: 8192, maxTokens: 2048}
  admission: {minConcurrency: 8}
"""
)


def make_spec(**changes):
    """BASE with dotted-path changes, e.g. make_spec(**{"kv.pages": 400})."""
    doc = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


def violations(**changes) -> tuple[str, ...]:
    return holdability(parse_modelpool(make_spec(**changes))).violations


class TestParse:
    def test_the_example_parses(self) -> None:
        pool = parse_modelpool(make_spec())
        assert pool.name == "llama-8b" and pool.namespace == "team-a"
        assert pool.architecture.kv_heads == 8
        assert pool.kv.pages == 20000 and pool.kv.speculative_tokens == 1
        assert pool.admission.min_concurrency == 8
        # the default: peak-fit with backfill, the same promise with more admitted
        assert (pool.admission.policy, pool.admission.backfill) == ("peak", True)
        assert pool.admission.ledger_policy == "peak+backfill"

    def test_a_peak_pool_is_judged_by_the_conservative_worst_case(self) -> None:
        """`kvbank check` and the webhook read the worst case whatever the ledger's policy."""
        peak = parse_modelpool(make_spec())
        conservative = parse_modelpool(
            make_spec(**{"admission.policy": "conservative", "admission.backfill": False})
        )
        assert holdability(peak) == holdability(conservative)
        assert holdability(peak).worst_concurrency == 38

    def test_a_preset_fills_the_architecture(self) -> None:
        pool = parse_modelpool(make_spec(**{"model.architecture": {"preset": "llama-3.1-8b"}}))
        assert pool.architecture.layers == 32 and pool.architecture.parameters == 8.03e9

    def test_every_problem_is_listed_at_once_with_its_field(self) -> None:
        doc = make_spec(
            **{"kv.pages": -4, "limits.maxSeqLen": "long", "replicas": 1.5, "kv.colour": 1}
        )
        with pytest.raises(SpecError) as err:
            parse_modelpool(doc)
        paths = [e.path for e in err.value.errors]
        assert paths == [
            "spec.replicas",
            "spec.kv.colour",
            "spec.kv.pages",
            "spec.limits.maxSeqLen",
        ]
        assert "must be from 2 to 16777216, got -4" in str(err.value)

    def test_missing_architecture_says_what_to_give(self) -> None:
        with pytest.raises(SpecError, match="give layers, attentionHeads.*or a preset"):
            parse_modelpool(make_spec(**{"model.architecture": None}))

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"kvSlots": {}}, "at least one KV label"),
            ({"kvSlots": {"main": {}}}, "writes nothing"),
            ({"kvSlots": {"main": {"prompt": -1}}}, "spec.kvSlots.main.prompt"),
            ({"limits.maxTokens": 8192}, "must be below maxSeqLen"),
            ({"gpu.memoryUtilization": 0}, "memoryUtilization: must be above 0"),
            ({"kv.memoryFraction": 0.5}, "either pages or memoryFraction"),
            ({"model.architecture.kvHeads": 5}, "must divide attentionHeads"),
            ({"model.architecture.dtype": "float64"}, "must be one of"),
            ({"admission.policy": "yolo"}, "conservative, peak"),
        ],
    )
    def test_bad_fields(self, changes, message) -> None:
        with pytest.raises(SpecError, match=message):
            parse_modelpool(make_spec(**changes))

    def test_names_the_crd_would_refuse(self) -> None:
        doc = make_spec(**{"model.name": "m" * 254})
        doc["metadata"]["name"] = "n" * 41
        with pytest.raises(SpecError) as err:
            parse_modelpool(doc)
        assert [e.path for e in err.value.errors] == ["metadata.name", "spec.model.name"]
        assert "has 41 characters; at most 40" in str(err.value)
        doc["metadata"]["name"] = "n" * 40
        with pytest.raises(SpecError, match="has 254 characters; at most 253"):
            parse_modelpool(doc)

    def test_wrong_kind_and_version(self) -> None:
        doc = make_spec()
        doc["kind"], doc["apiVersion"] = "Pod", "v1"
        with pytest.raises(SpecError, match="apiVersion: must be kvbank.dev/v1alpha1.*kind"):
            parse_modelpool(doc)

    def test_not_a_mapping(self) -> None:
        with pytest.raises(SpecError, match="must be a mapping"):
            parse_modelpool(["a", "list"])


class TestHoldability:
    def test_the_example_holds_38_worst_case_requests(self) -> None:
        result = holdability(parse_modelpool(make_spec()))
        assert result.ok, result.violations
        assert (result.worst_request_pages, result.worst_concurrency) == (513, 38)

    def test_rule_1_one_worst_case_request_must_fit(self) -> None:
        (message,) = violations(**{"kv.pages": 400, "admission": None})
        assert message == (
            "kv.pages=400 cannot hold one worst-case request (513 pages: maxSeqLen 8192 + 1 "
            "speculative token at pageSize 16). Raise kv.pages to at least 514, or lower "
            "limits.maxSeqLen to at most 6383."
        )

    def test_rule_1_boundary_one_sink_page(self) -> None:
        assert violations(**{"kv.pages": 514, "admission": None}) == ()
        assert len(violations(**{"kv.pages": 513, "admission": None})) == 1

    def test_rule_1_output_heavy_label_suggests_max_tokens(self) -> None:
        (message,) = violations(
            **{"kv.pages": 600, "admission": None, "kvSlots": {"main": {"prompt": 1, "output": 2}}}
        )
        # worst case: a 6144-token prompt and 2048 output tokens written twice, + 2 speculative
        assert "(641 pages: a 6144-token prompt with 2048 output tokens" in message
        # with maxTokens n the worst case is 8192 - n + 2 (n + 1) tokens <= 599 x 16
        assert "lower limits.maxTokens to at most 1390." in message

    def test_rule_2_min_concurrency(self) -> None:
        (message,) = violations(**{"kv.pages": 3000})
        assert message.startswith("admission.minConcurrency=8 needs 4105 pages")
        assert "holds 5" in message and "Raise kv.pages to at least 4105" in message

    def test_rule_3_memory(self) -> None:
        (message,) = violations(**{"kv.pages": 40000})
        assert "Lower kv.pages to at most 28181" in message
        pool = parse_modelpool(make_spec(**{"kv.pages": 28181}))
        assert page_bytes(pool) == 2 * 32 * 8 * 128 * 2 * 16
        assert holdability(pool).ok
        assert not holdability(parse_modelpool(make_spec(**{"kv.pages": 28182}))).ok

    def test_rule_3_weights_alone_do_not_fit(self) -> None:
        (message,) = violations(**{"gpu.memoryGiB": 16, "kv.pages": 600, "admission": None})
        assert "Raise tensorParallel above 1 or use a larger GPU" in message

    def test_rule_4_tensor_parallel_must_split_the_heads(self) -> None:
        found = violations(**{"tensorParallel": 3})
        assert any("does not divide model.architecture.attentionHeads=32" in v for v in found)
        assert any("cannot split model.architecture.kvHeads=8" in v for v in found)
        assert violations(**{"tensorParallel": 2}) == ()
        # TP above the KV heads replicates them: allowed when it is a multiple
        assert violations(**{"tensorParallel": 16}) == ()

    def test_pages_from_a_memory_fraction(self) -> None:
        pool = parse_modelpool(make_spec(**{"kv.pages": None, "kv.memoryFraction": 0.5}))
        # (80 x 0.9 GiB - 8.03e9 x 2 bytes - 2 GiB) x 0.5 / 2 MiB per page
        assert pool_pages(pool) == 14090
        assert holdability(pool).ok
