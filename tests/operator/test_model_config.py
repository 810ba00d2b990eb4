"""A `fromConfig.configMap` pool in the operator: its config.json read from the ConfigMap it
names (through the Cluster wrapper's fake), judged on that layout by the webhook and reconcile
as `kvbank check` judges the same file, and every way the ConfigMap can fail, a `path` the
cluster has no file for included, refused in one line naming the field."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from operator_fakes import FakeCluster
from operator_specs import namespace_doc, pool_doc, stored

from kvbank.capacity import holdability
from kvbank.capacity.configured import resolve
from kvbank.engine.serve.from_pool import read_pool as read_pool_for_engine
from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.admission import decide, neighbourhood, review
from kvbank.operator.model_config import ModelConfig, configured, read_model_config
from kvbank.operator.reconcile import reconcile, repair
from kvbank.operator.render.names import MODEL_CONFIG_FILE, POOL_FILE, RenderSettings
from kvbank.poolfile import read_pool

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
GPT_OSS = (CONFIGS / "gpt-oss-20b.json").read_text()
SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")
NOW = "2026-01-01T00:00:00Z"
FIELD = "spec.model.architecture.fromConfig"


def oss_doc(source: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """gpt-oss-20b (12 sliding-window and 12 full attention layers) from a ConfigMap, served by
    vLLM (kvbank's engine decodes full attention only)."""
    from_config = source if source is not None else {"configMap": {"name": "gpt-oss-20b"}}
    sections: dict[str, Any] = {
        "model": {"name": "gpt-oss-20b", "architecture": {"fromConfig": from_config}},
        "kv": {"pageSize": 16, "pages": 20000},
        "limits": {"maxSeqLen": 8192, "maxTokens": 2048, "maxNumBatchedTokens": 2048},
        "engine": {"kind": "vllm"},
        **spec,
    }
    doc = pool_doc("oss", **sections)
    del doc["spec"]["kvSlots"]
    return doc


def config_map(data: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gpt-oss-20b", "namespace": "team-a"},
        "data": {"config.json": GPT_OSS} if data is None else data,
        **extra,
    }


def cluster_with(*objects: dict[str, Any]) -> FakeCluster:
    cluster = FakeCluster()
    cluster.put(namespace_doc("team-a"))
    for obj in objects:
        cluster.put(obj)
    return cluster


def judged(cluster: FakeCluster, doc: dict[str, Any]):
    around = asyncio.run(neighbourhood(cluster, doc, earlier_only=False))
    return decide(doc, around)


def one_refusal(cluster: FakeCluster, doc: dict[str, Any]) -> str:
    decision = judged(cluster, doc)
    assert not decision.ok
    (line,) = decision.violations
    assert "\n" not in line and "Traceback" not in line
    return line


class TestRead:
    def test_the_key_of_the_named_config_map_in_the_pools_namespace(self) -> None:
        cluster = cluster_with(config_map())
        found = asyncio.run(read_model_config(cluster, oss_doc()))
        assert found == ModelConfig("ConfigMap team-a/gpt-oss-20b key config.json", GPT_OSS)
        assert cluster.calls == [("get", "ConfigMap/gpt-oss-20b")]

    def test_binary_data_and_another_key(self) -> None:
        encoded = base64.b64encode(GPT_OSS.encode()).decode()
        cluster = cluster_with(config_map({}, binaryData={"oss.json": encoded}))
        doc = oss_doc({"configMap": {"name": "gpt-oss-20b", "key": "oss.json"}})
        found = asyncio.run(read_model_config(cluster, doc))
        assert found is not None and found.text == GPT_OSS.encode()

    def test_a_pool_described_by_hand_or_malformed_reads_nothing(self) -> None:
        cluster = cluster_with(config_map())
        assert asyncio.run(read_model_config(cluster, pool_doc())) is None
        assert asyncio.run(read_model_config(cluster, oss_doc(replicas=-1))) is None
        assert cluster.calls == []


class TestJudged:
    def test_on_the_layout_kvbank_check_derives_from_the_same_file(self, tmp_path: Path) -> None:
        doc = oss_doc()
        decision = judged(cluster_with(config_map()), doc)
        assert decision.ok and decision.reason == "Holdable"
        assert decision.held is not None
        assert (decision.held.worst_request_pages, decision.held.worst_concurrency) == (777, 25)
        (tmp_path / "config.json").write_text(GPT_OSS)
        local = oss_doc({"path": "config.json"})
        pool = parse_modelpool(local)
        assert holdability(pool, resolve(pool, tmp_path)) == decision.held
        assert [g.status() for g in decision.groups] == [
            {
                "name": "sliding",
                "kind": "sliding",
                "layers": 12,
                "pageBytes": 393216,
                "rule": "window 128: at most 265 pages",
                "worstRequestPages": 265,
            },
            {
                "name": "full",
                "kind": "full",
                "layers": 12,
                "pageBytes": 393216,
                "rule": "every position",
                "worstRequestPages": 512,
            },
        ]
        assert decision.warnings == ()

    def test_an_unholdable_layout_says_what_to_change(self) -> None:
        decision = judged(cluster_with(config_map()), oss_doc(kv={"pageSize": 16, "pages": 500}))
        assert decision.reason == "Unholdable"
        assert decision.violations[0].startswith(
            "kv.pages=500 cannot hold one worst-case request (777 pages"
        )


class TestRefused:
    def test_a_path_means_no_file_in_the_cluster(self) -> None:
        line = one_refusal(cluster_with(), oss_doc({"path": "gpt-oss-20b/config.json"}))
        assert line.startswith(f"{FIELD}.path: names a file, and the operator reads none")
        assert "fromConfig: {configMap: {name: NAME}}" in line

    def test_a_missing_config_map(self) -> None:
        line = one_refusal(cluster_with(), oss_doc())
        assert line == (
            f"{FIELD}.configMap.name: names ConfigMap gpt-oss-20b, which namespace team-a does "
            "not have. Create it from the model's config.json (kubectl create configmap "
            "gpt-oss-20b -n team-a --from-file=config.json=config.json) or name the one that "
            "holds it"
        )

    def test_a_config_map_in_another_namespace_is_not_read(self) -> None:
        elsewhere = config_map()
        elsewhere["metadata"]["namespace"] = "team-b"
        line = one_refusal(cluster_with(elsewhere), oss_doc())
        assert line.startswith(f"{FIELD}.configMap.name: names ConfigMap gpt-oss-20b")

    def test_a_missing_key_names_the_keys_there(self) -> None:
        cluster = cluster_with(config_map({"config.jsn": GPT_OSS, "README": "x"}))
        line = one_refusal(cluster, oss_doc())
        assert line == (
            f"{FIELD}.configMap.key: 'config.json' is not a key of ConfigMap "
            "team-a/gpt-oss-20b (it has 'README', 'config.jsn'). Set key to the one holding "
            "the model's config.json, or add it to the ConfigMap"
        )

    @pytest.mark.parametrize(
        ("text", "words"),
        [
            (" " * (1 << 20) + "{}", "is over 1048576 bytes; a model's config is a few KiB"),
            ('{"model_type": "gpt_oss", "hidden_size": NaN}', "is not valid JSON"),
            ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
            ('{"a": ' * 70 + "1" + "}" * 70, "nests deeper than 64 levels"),
            ("[1, 2]", "must be a JSON object, got list"),
            ("not json", "is not valid JSON"),
            (json.dumps({**json.loads(GPT_OSS), "num_hidden_layers": 0}), "num_hidden_layers"),
            (json.dumps({**json.loads(GPT_OSS), "model_type": "falcon9"}), "not a family"),
        ],
        ids=["oversized", "nan", "deep-json", "deep-object", "list", "garbage", "field", "family"],
    )
    def test_a_hostile_or_broken_config(self, text: str, words: str) -> None:
        line = one_refusal(cluster_with(config_map({"config.json": text})), oss_doc())
        assert line.startswith(f"{FIELD}.configMap"), line
        assert words in line
        assert len(line) < 400

    def test_binary_data_that_is_not_base64(self) -> None:
        cluster = cluster_with(config_map({}, binaryData={"config.json": "%%%"}))
        line = one_refusal(cluster, oss_doc())
        assert line == (
            f"{FIELD}.configMap.key: ConfigMap team-a/gpt-oss-20b key config.json is not valid "
            "base64 binaryData"
        )

    def test_a_tensor_parallel_the_layout_cannot_split(self) -> None:
        line = one_refusal(cluster_with(config_map()), oss_doc(tensorParallel=3))
        assert line.startswith("spec.tensorParallel: 3 does not divide the model's 64 attention")

    @pytest.mark.parametrize(
        ("config_map_ref", "field"),
        [
            ({"name": "../secrets/x"}, f"{FIELD}.configMap.name"),
            ({"name": "Gpt"}, f"{FIELD}.configMap.name"),
            ({"name": "gpt", "key": "a/b"}, f"{FIELD}.configMap.key"),
        ],
    )
    def test_a_name_or_key_kubernetes_cannot_hold_is_a_spec_error(
        self, config_map_ref: dict[str, str], field: str
    ) -> None:
        with pytest.raises(SpecError) as caught:
            parse_modelpool(oss_doc({"configMap": config_map_ref}))
        assert [e.path for e in caught.value.errors] == [field]


class TestWebhook:
    def test_admits_a_holdable_pool(self) -> None:
        warnings: list[str] = []
        refusal = asyncio.run(
            review(cluster_with(config_map()), oss_doc(), None, warnings=warnings)
        )
        assert refusal is None and warnings == []

    def test_refuses_in_one_message_naming_the_field(self) -> None:
        refusal = asyncio.run(review(cluster_with(), oss_doc(), None))
        assert refusal is not None
        assert refusal.splitlines() == [
            "ModelPool team-a/oss: 1 violation(s):",
            f"  - {FIELD}.configMap.name: names ConfigMap gpt-oss-20b, which namespace team-a "
            "does not have. Create it from the model's config.json (kubectl create configmap "
            "gpt-oss-20b -n team-a --from-file=config.json=config.json) or name the one that "
            "holds it",
        ]


def rendered_files(cluster: FakeCluster, folder: Path) -> Path:
    """The pool's rendered ConfigMap written out as a rank's pod mounts it; the manifest's path."""
    (config,) = [c for c in cluster.kinds("ConfigMap") if c["metadata"]["name"].startswith("oss-")]
    for key, text in config["data"].items():
        (folder / key).write_text(text)
    return folder / POOL_FILE


def engine_args(cluster: FakeCluster) -> list[str]:
    (sts,) = cluster.kinds("StatefulSet")
    containers = sts["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "engine")["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


class TestReconcile:
    def test_renders_the_config_it_judged_and_the_ranks_resolve_the_same_pool(
        self, tmp_path: Path
    ) -> None:
        cluster = cluster_with(config_map(), stored(oss_doc()))
        outcome = asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert outcome.accepted, outcome.message
        status = cluster.one("ModelPool", "oss")["status"]
        assert (status["pages"], status["worstRequestPages"], status["worstConcurrency"]) == (
            20000,
            777,
            25,
        )
        assert [(g["name"], g["layers"], g["worstRequestPages"]) for g in status["groups"]] == [
            ("sliding", 12, 265),
            ("full", 12, 512),
        ]
        accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("True", "Holdable")
        manifest = rendered_files(cluster, tmp_path)
        served = json.loads(manifest.read_text())["spec"]["model"]["architecture"]
        assert served == {"fromConfig": {"path": MODEL_CONFIG_FILE}}
        assert json.loads((tmp_path / MODEL_CONFIG_FILE).read_text()) == json.loads(GPT_OSS)
        ranks = read_pool(str(manifest), "this sidecar")  # what `kvbank sidecar --pool` reads
        pool = parse_modelpool(oss_doc())
        judged = holdability(pool, configured(pool, ModelConfig("x", GPT_OSS)))
        assert ranks.held == judged
        assert list(ranks.kv_slots) == ["sliding", "full"]
        args = engine_args(cluster)
        assert flag(args, "--num-gpu-blocks-override") == "20000"
        assert flag(args, "--max-num-batched-tokens") == "2048"  # the windows' caps count it
        assert "--kv-cache-dtype" not in args

    def test_a_memory_fraction_is_pinned_to_the_pages_judged(self, tmp_path: Path) -> None:
        doc = oss_doc(
            kv={"pageSize": 16, "memoryFraction": 0.9},
            gpu={"memoryGiB": 80, "memoryUtilization": 0.9},
        )
        doc["spec"]["model"]["architecture"]["fromConfig"]["kvDtype"] = "fp8"
        cluster = cluster_with(config_map(), stored(doc))
        assert asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        pages = cluster.one("ModelPool", "oss")["status"]["pages"]
        assert pages > 100_000  # fp8 pages of a 13 GiB model's 59 GiB left, not 20000
        args = engine_args(cluster)
        assert flag(args, "--num-gpu-blocks-override") == str(pages)
        assert flag(args, "--kv-cache-dtype") == "fp8"
        assert read_pool(str(rendered_files(cluster, tmp_path)), "the engine").pages == pages

    def test_kvbank_engine_serves_a_config_of_full_attention(self, tmp_path: Path) -> None:
        llama = (CONFIGS / "llama-3.1-8b.json").read_text()
        doc = oss_doc({"configMap": {"name": "gpt-oss-20b"}}, engine={"kind": "kvbank"})
        cluster = cluster_with(config_map({"config.json": llama}), stored(doc))
        outcome = asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert outcome.accepted, outcome.message
        args = engine_args(cluster)
        assert flag(args, "--pages") == "20000" and "--max-num-batched-tokens" not in args
        served = read_pool_for_engine(str(rendered_files(cluster, tmp_path)))
        assert list(served.kv_slots) == ["full"]

    def test_kvbank_engine_refuses_a_layout_it_cannot_decode(self) -> None:
        line = one_refusal(cluster_with(config_map()), oss_doc(engine={"kind": "kvbank"}))
        assert line == (
            "spec.engine.kind: kvbank's engine decodes one KV group of full attention, and "
            "this model's config.json lays it out in 2 group(s) of full, sliding (sliding (12 "
            "layers), full (12 layers)). Set spec.engine.kind: vllm to serve it."
        )

    def test_a_vllm_flag_that_changes_the_layout_is_refused(self) -> None:
        doc = oss_doc(engine={"kind": "vllm", "args": ["--max-num-batched-tokens=512"]})
        assert one_refusal(cluster_with(config_map()), doc) == (
            "spec.engine.args[0]: sets --max-num-batched-tokens, which decides the KV layout "
            "judged from the model's config.json; drop it and set "
            "spec.limits.maxNumBatchedTokens"
        )

    def test_a_vllm_model_with_mamba_state_must_turn_prefix_caching_off(self) -> None:
        jamba = (CONFIGS / "jamba-v0.1.json").read_text()
        cluster = cluster_with(config_map({"config.json": jamba}))
        (line,) = [v for v in judged(cluster, oss_doc()).violations if "prefix caching" in v]
        assert line.startswith("spec.engine.args: this model keeps mamba state (")
        assert line.endswith("add --no-enable-prefix-caching to spec.engine.args")
        off = oss_doc(engine={"kind": "vllm", "args": ["--no-enable-prefix-caching"]})
        assert not [v for v in judged(cluster, off).violations if "prefix caching" in v]

    def test_repair_renders_only_the_config_judged(self) -> None:
        cluster = cluster_with(config_map(), stored(oss_doc()))
        asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        before = cluster.one("ModelPool", "oss")["status"]["configHash"]
        again = asyncio.run(repair(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert again is not None and again.accepted and again.applied == ()
        # The ConfigMap edited where no watch event reached the operator: judged again.
        wider = json.dumps({**json.loads(GPT_OSS), "sliding_window": 256})
        cluster.put(config_map({"config.json": wider}))
        again = asyncio.run(repair(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert again is not None and again.accepted
        status = cluster.one("ModelPool", "oss")["status"]
        assert status["configHash"] != before
        assert status["groups"][0]["rule"] == "window 256: at most 273 pages"

    def test_an_edit_of_spacing_or_key_order_rolls_no_pod(self) -> None:
        cluster = cluster_with(config_map(), stored(oss_doc()))
        asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        before = cluster.one("ModelPool", "oss")["status"]["configHash"]
        reordered = dict(reversed(list(json.loads(GPT_OSS).items())))
        cluster.put(config_map({"config.json": json.dumps(reordered, indent=4)}))
        asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert cluster.one("ModelPool", "oss")["status"]["configHash"] == before

    def test_a_missing_config_map_is_refused_in_the_status(self) -> None:
        cluster = cluster_with(stored(oss_doc()))
        asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        (accepted,) = cluster.one("ModelPool", "oss")["status"]["conditions"]
        assert (accepted["status"], accepted["reason"]) == ("False", "InvalidConfig")
        assert f"  - {FIELD}.configMap.name: names ConfigMap gpt-oss-20b" in accepted["message"]

    def test_a_pool_rewritten_by_hand_drops_its_groups(self) -> None:
        cluster = cluster_with(config_map(), stored(oss_doc()))
        asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        by_hand = cluster.one("ModelPool", "oss")
        by_hand["spec"] = pool_doc()["spec"]
        cluster.put(by_hand)
        outcome = asyncio.run(reconcile(cluster, SETTINGS, cluster.one("ModelPool", "oss"), NOW))
        assert outcome.accepted
        assert "groups" not in cluster.one("ModelPool", "oss")["status"]
