"""`kvbank bench --engine vllm` where no vLLM is needed to answer: scenarios vLLM cannot express,
unknown policies, no vLLM to run with; and the scheduler class's environment settings.
(The runs themselves: tests/vllm_scheduler, in vLLM's own environment.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.cli import main
from kvbank.vllm.layout import GroupSpec, Limits, UnsupportedLayout, capacity_model, check_layout
from kvbank.vllm.settings import Settings, SettingsError, from_env

ONE_LABEL = """
name: one-label
pool: {pages: 40, page_size: 4}
model: {kv_slots: {main: {prompt: 1, output: 1}}, max_seq_len: 64}
workload:
  concurrency: 2
  requests: 4
  classes: [{weight: 1, prompt_tokens: 8, max_tokens: 4, output_tokens: 4}]
"""


def _bench(tmp_path: Path, text: str, *args: str) -> int:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return main(["bench", "--engine", "vllm", "--scenario", str(path), *args])


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            ONE_LABEL.replace("{main: {prompt: 1, output: 1}}", "{a: {prompt: 1}, b: {fixed: 8}}"),
            "label 'a' writes 1 per prompt token",
        ),
        (
            ONE_LABEL.replace("output: 1}}", "output: 1}, s: {fixed: 8}}"),
            "holds 1 + speculative_tokens pages (fixed: 4)",
        ),
        (ONE_LABEL.replace("output: 1}}", "output: 1, fixed: 16}}"), "16 fixed tokens"),
        (ONE_LABEL.replace("{prompt: 1, output: 1}}", "{prompt: 2, output: 1}}"), "2 per prompt"),
        (
            ONE_LABEL.replace(
                "output_tokens: 4}", "output_tokens: 4, fixed_label_tokens: {main: 9}}"
            ),
            "sets fixed_label_tokens",
        ),
    ],
)
def test_a_scenario_vllm_cannot_express_is_refused_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    assert _bench(tmp_path, text, "--policy", "vllm") == 2
    err = capsys.readouterr().err
    assert "--engine vllm cannot run one-label" in err
    assert why in err
    assert "--engine kvbank only" in err


def test_a_kvbank_policy_on_the_vllm_engine_is_refused_naming_the_vllm_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(tmp_path, ONE_LABEL, "--policy", "vllm,peak+backfill") == 2
    err = capsys.readouterr().err
    assert "unknown --policy 'peak+backfill' for --engine vllm" in err
    assert "vllm, vllm+banker, vllm+peak+backfill" in err


def test_backfill_flag_is_refused_on_the_vllm_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(tmp_path, ONE_LABEL, "--policy", "vllm+banker", "--backfill") == 2
    assert "name vllm+peak+backfill in --policy" in capsys.readouterr().err


def test_no_python_with_vllm_is_refused_with_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this environment has vllm: the bench runs in-process")
    monkeypatch.setenv("KVBANK_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert _bench(tmp_path, ONE_LABEL, "--policy", "vllm") == 2
    err = capsys.readouterr().err
    assert "make vllm-venv" in err
    assert "no-such-python does not exist" in err


def test_settings_default_to_an_embedded_peak_backfill_ledger() -> None:
    assert from_env({}) == Settings("peak+backfill")
    assert (from_env({}).order, from_env({}).max_defer_steps) == ("fifo", 2048)
    assert from_env({"KVBANK_POLICY": "banker"}).policy == "banker"
    got = from_env({"KVBANK_ORDER": "prefix", "KVBANK_MAX_DEFER_STEPS": "0"})
    assert (got.order, got.max_defer_steps) == ("prefix", 0)
    over_a_sidecar = from_env({"KVBANK_ORDER": "prefix", "KVBANK_SIDECAR": "unix:///run/s.sock"})
    assert (over_a_sidecar.order, over_a_sidecar.sidecar) == ("prefix", "unix:///run/s.sock")


@pytest.mark.parametrize(
    ("env", "variable", "says"),
    [
        ({"KVBANK_POLICY": "fifo"}, "KVBANK_POLICY", "set one of banker"),
        ({"KVBANK_SIDECAR": "localhost"}, "KVBANK_SIDECAR", "is not host:port"),
        ({"KVBANK_SIDECAR": "127.0.0.1:99999"}, "KVBANK_SIDECAR", "is not host:port"),
        ({"KVBANK_SIDECAR": "unix://run/s.sock"}, "KVBANK_SIDECAR", "with an absolute path"),
        ({"KVBANK_SIDECAR": "unix:///"}, "KVBANK_SIDECAR", "is not unix:///PATH"),
        ({"KVBANK_SIDECAR_TOKEN_FILE": "/t"}, "KVBANK_SIDECAR_TOKEN_FILE", "KVBANK_SIDECAR is not"),
        ({"KVBANK_ORDER": "lpm"}, "KVBANK_ORDER", "set one of fifo, prefix"),
        ({"KVBANK_MAX_DEFER_STEPS": "-1"}, "KVBANK_MAX_DEFER_STEPS", "0 or more"),
        ({"KVBANK_MAX_DEFER_STEPS": "many"}, "KVBANK_MAX_DEFER_STEPS", "is not an integer"),
        (
            {"KVBANK_SIDECAR": "127.0.0.1:1", "KVBANK_SIDECAR_TOKEN_FILE": "/nonexistent/t"},
            "KVBANK_SIDECAR_TOKEN_FILE",
            "cannot read '/nonexistent/t'",
        ),
    ],
)
def test_bad_settings_name_the_variable_and_what_to_set(
    env: dict[str, str], variable: str, says: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        from_env(env)
    assert refused.value.variable == variable
    assert says in str(refused.value)


def test_a_unix_socket_sidecar_is_taken_and_a_served_engine_never_waits() -> None:
    got = from_env({"KVBANK_SIDECAR": "unix:///var/run/kvbank/sidecar.sock"})
    assert (got.sidecar, got.blocking) == ("unix:///var/run/kvbank/sidecar.sock", False)


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        from_env({"KVBANK_SIDECAR": "127.0.0.1:5", "KVBANK_SIDECAR_TOKEN_FILE": str(token)})
    token.write_text("s3cret\n")
    got = from_env({"KVBANK_SIDECAR": "127.0.0.1:5", "KVBANK_SIDECAR_TOKEN_FILE": str(token)})
    assert (got.sidecar, got.token) == ("127.0.0.1:5", "s3cret")


def test_each_group_is_a_label_with_its_own_rule() -> None:
    groups = [
        GroupSpec("FullAttentionSpec", 4, block_size=16),
        GroupSpec("SlidingWindowSpec", 28, sliding_window=4096, block_size=16),
        GroupSpec("MambaSpec", 8, block_size=4096),
    ]
    model = capacity_model(groups, Limits(16, 32768, 0, max_num_batched_tokens=2048))
    assert list(model.kv_slots) == ["g0-full", "g1-sliding", "g2-mamba2"]
    assert model.label_caps == {"g1-sliding": (4095 + 2048 + 15) // 16 + 1}
    assert model.kv_slots["g2-mamba2"].fixed == 16  # one page of state
    with pytest.raises(UnsupportedLayout, match="CrossAttentionSpec"):
        check_layout([GroupSpec("FullAttentionSpec", 4), GroupSpec("CrossAttentionSpec", 4)])
    with pytest.raises(UnsupportedLayout, match="mamba_cache_mode align"):
        check_layout([GroupSpec("MambaSpec", 4, mamba_cache_mode="align")])
    check_layout([GroupSpec("FullAttentionSpec", 32, sliding_window=4096)])  # every position


def test_the_capacity_model_is_vllms_block_size_and_limits() -> None:
    model = capacity_model([GroupSpec("FullAttentionSpec", 32)], Limits(16, 4096, 2))
    assert (model.page_size, model.max_seq_len, model.max_tokens) == (16, 4096, 4095)
    assert model.speculative_tokens == 2


@pytest.mark.slow
def test_the_bench_runs_itself_under_vllms_python_and_prints_the_same_fields(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import importlib.util
    import json

    from kvbank.engine.bench.vllm_cli import vllm_python

    if importlib.util.find_spec("vllm") is not None or vllm_python() is None:
        pytest.skip("needs this Python without vllm and .venv-vllm beside it (make vllm-venv)")
    assert _bench(tmp_path, ONE_LABEL, "--policy", "vllm,vllm+peak+backfill", "--json") == 0
    runs = json.loads(capfd.readouterr().out)
    assert [r["policy"] for r in runs] == ["vllm", "vllm+peak+backfill"]
    for run in runs:
        assert (run["completed"], run["hung"], run["preemptions"]) == (4, 0, 0)
    own = main(["bench", "--scenario", str(tmp_path / "scenario.yaml"), "--json"])
    assert own == 0
    fields = set(json.loads(capfd.readouterr().out)[0])
    assert fields <= set(runs[0])  # every field kvbank's engine prints, and `engine`


def test_a_hybrid_scenario_is_one_kv_cache_group_per_label() -> None:
    from kvbank.engine.bench.scenario import load_scenario
    from kvbank.engine.bench.vllm_cli import scenario_refusal

    root = Path(__file__).resolve().parents[2]
    hybrid = load_scenario(root / "scenarios" / "hybrid-window.yaml")
    assert hybrid.kv_windows == {"window": ("sliding_window", 256)}
    assert scenario_refusal(hybrid) is None


def test_a_label_with_both_a_window_and_a_chunk_is_refused(tmp_path: Path) -> None:
    text = ONE_LABEL.replace("output: 1}}", "output: 1, sliding_window: 8, attention_chunk: 8}}")
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    from kvbank.engine.bench.scenario import ScenarioError, load_scenario

    with pytest.raises(ScenarioError, match="give one of sliding_window or attention_chunk"):
        load_scenario(path)
