"""ModelPool `spec.admission`'s service classes and `spec.kv.hostPages`: read by the parser
with errors that say what to write, rendered into `kvbank serve`'s command and vLLM's
environment, refused where the vllm engine would not carry them out, judged by the webhook's
logic, and reported by `kvbank check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_specs import pool_doc

from kvbank.deployment import SpecError, parse_deployment
from kvbank.modelpool import Admission, parse_modelpool
from kvbank.operator.admission import Neighbourhood, decide
from kvbank.operator.render.engines import engine_command, vllm_env
from kvbank.operator.render.names import RenderSettings
from kvbank.service_class import ClassPolicy, Estimate, ServiceClass, Victim

SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")
KV = {"pageSize": 16, "pages": 20000, "speculativeTokens": 1}
ROOT = Path(__file__).resolve().parents[2]


def errors_of(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_modelpool(doc)
    return [str(e) for e in caught.value.errors]


def args_of(**spec: Any) -> list[str]:
    doc = pool_doc(**spec)
    return engine_command(parse_modelpool(doc), SETTINGS, parse_deployment(doc), False).args


class TestParse:
    def test_a_pool_that_names_no_class_is_strict_with_the_engines_defaults(self) -> None:
        admission = parse_modelpool(pool_doc()).admission
        assert admission.classes == ClassPolicy()
        assert admission.estimate is Estimate.LEARNED
        assert parse_modelpool(pool_doc()).kv.host_pages == 0

    def test_every_field_is_read(self) -> None:
        best = {"maxPreemptions": 0, "victim": "cheapest", "estimate": "ratio"}
        doc = pool_doc(admission={"defaultClass": "best-effort", "bestEffort": best},
                       kv={**KV, "hostPages": 4096})  # fmt: skip
        pool = parse_modelpool(doc)
        assert pool.admission.classes == ClassPolicy(
            ServiceClass.BEST_EFFORT, 0, Victim.CHEAPEST, Estimate.RATIO
        )
        assert pool.kv.host_pages == 4096

    @pytest.mark.parametrize(
        ("admission", "message"),
        [
            ({"defaultClass": "flex"}, "spec.admission.defaultClass: 'flex' is a service_tier, "
             "not a class; write defaultClass: best-effort (one of strict, best-effort)"),
            ({"defaultClass": "priority"}, "write defaultClass: strict"),
            ({"defaultClass": "gold"}, "spec.admission.defaultClass: must be one of strict, "
             "best-effort, got 'gold'"),
            ({"bestEffort": {"maxPreemptions": -1}}, "spec.admission.bestEffort.maxPreemptions: "
             "must be from 0 to 64, got -1"),
            ({"bestEffort": {"maxPreemptions": "2"}}, "maxPreemptions: must be an integer"),
            ({"bestEffort": {"victim": "oldest"}}, "spec.admission.bestEffort.victim: must be "
             "one of newest, cheapest, got 'oldest'"),
            ({"bestEffort": {"estimate": "oracle"}}, "spec.admission.bestEffort.estimate: must "
             "be one of learned, ratio, got 'oracle'"),
            ({"bestEffort": {"budget": 3}}, "spec.admission.bestEffort.budget: is not a known "
             "field; known: estimate, maxPreemptions, victim"),
            ({"bestEffort": []}, "spec.admission.bestEffort: must be a mapping, got list"),
        ],
    )  # fmt: skip
    def test_a_bad_class_field_says_what_to_write(
        self, admission: dict[str, Any], message: str
    ) -> None:
        errors = errors_of(pool_doc(admission=admission))
        assert len(errors) == 1 and message in errors[0], errors

    def test_a_negative_host_tier_is_refused(self) -> None:
        (error,) = errors_of(pool_doc(kv={**KV, "hostPages": -1}))
        assert error == "spec.kv.hostPages: must be from 0 to 16777216, got -1"


class TestRender:
    def test_a_pool_that_sets_nothing_keeps_its_command(self) -> None:
        args = args_of(admission={"defaultClass": "strict", "bestEffort": {
            "maxPreemptions": Admission.max_preemptions, "victim": "newest",
            "estimate": "learned"}})  # fmt: skip
        assert args == args_of()
        for flag in ("--default-class", "--max-preemptions", "--victim", "--estimate",
                     "--host-pages"):  # fmt: skip
            assert flag not in args

    def test_the_class_settings_and_the_host_tier_reach_kvbank_serve(self) -> None:
        best = {"maxPreemptions": 5, "victim": "cheapest", "estimate": "ratio"}
        args = args_of(admission={"defaultClass": "best-effort", "bestEffort": best},
                       kv={**KV, "hostPages": 512})  # fmt: skip
        rendered = args[args.index("--host-pages") :]
        assert rendered == ["--host-pages", "512", "--default-class", "best-effort",
                            "--max-preemptions", "5", "--victim", "cheapest",
                            "--estimate", "ratio"]  # fmt: skip

    def test_the_rendered_command_parses_as_kvbank_serve_does(self) -> None:
        from kvbank import cli
        from kvbank.engine.serve.flags import options_from_args

        args = args_of(admission={"defaultClass": "best-effort",
                                  "bestEffort": {"maxPreemptions": 0, "victim": "cheapest",
                                                 "estimate": "ratio"}},
                       kv={**KV, "hostPages": 64})[1:]  # fmt: skip
        options = options_from_args(cli.build_parser(args).parse_args(args))
        assert options.classes == ClassPolicy(
            ServiceClass.BEST_EFFORT, 0, Victim.CHEAPEST, Estimate.RATIO
        )
        assert options.host_pages == 64

    @pytest.mark.parametrize(
        "flag", ["--victim=cheapest", "--host-pages", "--default-class", "--estimate"]
    )
    def test_engine_args_may_not_set_a_rendered_flag(self, flag: str) -> None:
        with pytest.raises(SpecError, match=f"sets {flag.split('=')[0]}, which the operator"):
            parse_deployment(pool_doc(engine={"args": [flag]}))


VLLM = {"kind": "vllm"}


class TestVllm:
    @pytest.mark.parametrize(
        ("spec", "message"),
        [
            ({"kv": {**KV, "hostPages": 8}}, "spec.kv.hostPages: is 8, but spec.engine.kind "
             "vllm has no host tier kvbank's ledger counts"),
            ({"admission": {"bestEffort": {"victim": "cheapest", "estimate": "ratio"}}},
             "spec.admission.bestEffort: sets estimate, victim, but under spec.engine.kind "
             "vllm a best-effort request is preempted latest first"),
            ({"admission": {"bestEffort": {"maxPreemptions": 5, "victim": "cheapest"}}},
             "spec.admission.bestEffort: sets victim, but"),
        ],
    )  # fmt: skip
    def test_what_vllm_would_not_carry_out_is_refused(
        self, spec: dict[str, Any], message: str
    ) -> None:
        with pytest.raises(SpecError) as caught:
            parse_deployment(pool_doc(engine=VLLM, **spec))
        (error,) = caught.value.errors
        assert message in str(error)

    def test_the_defaults_as_the_crd_fills_them_pass(self) -> None:
        best = {"maxPreemptions": 2, "victim": "newest", "estimate": "learned"}
        doc = pool_doc(engine=VLLM, admission={"defaultClass": "strict", "bestEffort": best},
                       kv={**KV, "hostPages": 0})  # fmt: skip
        parse_deployment(doc)
        args = engine_command(parse_modelpool(doc), SETTINGS, parse_deployment(doc), False).args
        assert not {"--host-pages", "--default-class", "--kv-offloading-size"} & set(args)

    def test_the_classes_reach_the_scheduler_class_as_its_environment(self) -> None:
        # kvbank/vllm/classes.py runs both classes; its settings are KVBANK_* variables
        doc = pool_doc(engine=VLLM, admission={"defaultClass": "best-effort",
                                               "bestEffort": {"maxPreemptions": 5}})  # fmt: skip
        deployment = parse_deployment(doc)
        env = vllm_env(parse_modelpool(doc), SETTINGS, deployment, tls=False)
        values = {e["name"]: e["value"] for e in env}
        assert values["KVBANK_DEFAULT_CLASS"] == "best-effort"
        assert values["KVBANK_MAX_PREEMPTIONS"] == "5"
        strict = {e["name"]: e["value"] for e in vllm_env(
            parse_modelpool(pool_doc(engine=VLLM)), SETTINGS, parse_deployment(pool_doc(
                engine=VLLM)), tls=False)}  # fmt: skip
        assert (strict["KVBANK_DEFAULT_CLASS"], strict["KVBANK_MAX_PREEMPTIONS"]) == ("strict", "2")


class TestOrder:
    """spec.admission.order: vLLM's scheduler class carries it out (KVBANK_ORDER)."""

    @staticmethod
    def env(doc: dict[str, Any]) -> dict[str, str]:
        deployment = parse_deployment(doc)
        env = vllm_env(parse_modelpool(doc), SETTINGS, deployment, tls=False)
        return {e["name"]: e["value"] for e in env}

    def test_it_reaches_the_scheduler_class_and_defaults_to_arrival(self) -> None:
        assert parse_modelpool(pool_doc()).admission.order == "fifo"
        assert self.env(pool_doc(engine=VLLM))["KVBANK_ORDER"] == "fifo"
        doc = pool_doc(engine=VLLM, admission={"order": "prefix"})
        assert parse_modelpool(doc).admission.order == "prefix"
        assert self.env(doc)["KVBANK_ORDER"] == "prefix"

    def test_a_bad_order_names_the_choices(self) -> None:
        assert errors_of(pool_doc(admission={"order": "lpm"})) == [
            "spec.admission.order: must be one of fifo, prefix, got 'lpm'"
        ]

    def test_kvbanks_own_engine_refuses_the_prefix_order(self) -> None:
        with pytest.raises(SpecError) as caught:
            parse_deployment(pool_doc(admission={"order": "prefix"}))
        (error,) = caught.value.errors
        assert str(error).startswith("spec.admission.order: is prefix, which kvbank's scheduler")
        assert "set spec.engine.kind: vllm" in str(error)
        parse_deployment(pool_doc(admission={"order": "fifo"}))  # arrival order: its own


class TestWebhookLogic:
    AROUND = Neighbourhood({}, [], [])

    def test_the_webhook_refuses_a_vllm_host_tier(self) -> None:
        doc = pool_doc(engine={"kind": "vllm"}, kv={**KV, "hostPages": 8})
        decision = decide(doc, self.AROUND)
        assert decision.reason == "InvalidSpec"
        assert any("spec.kv.hostPages: is 8" in v for v in decision.violations)

    def test_the_webhook_refuses_the_prefix_order_under_kvbanks_engine(self) -> None:
        decision = decide(pool_doc(admission={"order": "prefix"}), self.AROUND)
        assert decision.reason == "InvalidSpec"
        assert any("spec.admission.order: is prefix" in v for v in decision.violations)
        assert decide(pool_doc(engine=VLLM, admission={"order": "prefix"}), self.AROUND).ok

    def test_the_class_fields_add_no_warning(self) -> None:
        doc = pool_doc(admission={"bestEffort": {"estimate": "ratio"}})
        decision = decide(doc, self.AROUND)
        assert decision.ok and decision.warnings == ()


def test_kvbank_check_says_the_default_class(tmp_path: Path) -> None:
    strict = pool_doc("a")
    tuned = {"maxPreemptions": 3, "victim": "cheapest"}
    best = pool_doc("b", admission={"defaultClass": "best-effort", "bestEffort": tuned})
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump_all([strict, best]))
    out = subprocess.run([sys.executable, "-m", "kvbank.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    a, b = out.stdout.splitlines()
    assert "holds 38 worst-case requests at once; default class strict" in a
    assert ("holds 38 worst-case requests at once; default class best-effort (preempted at "
            "most 3 times, cheapest first") in b  # fmt: skip


def test_kvbank_check_refuses_what_vllm_would_not_carry_out(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(pool_doc(engine=VLLM, kv={**KV, "hostPages": 8})))
    out = subprocess.run([sys.executable, "-m", "kvbank.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert "spec.kv.hostPages: is 8, but spec.engine.kind vllm has no host tier" in out.stderr
