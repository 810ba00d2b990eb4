"""Hostile and careless manifest files: `kvbank check` (and every reader of the same parser) answers
exit 2 with a short message at a bounded cost, never a traceback, a hang or gigabytes of memory.

The costs are bounded by running the real command under resource limits (address space and CPU
seconds), not by timing it: a file that breaks a limit is killed or fails, whatever the box's load.
"""

from __future__ import annotations

import itertools
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvbank.fields import MAX_VALUES, QUOTE_LIMIT, quote
from kvbank.manifests import MAX_DEPTH, MAX_DOCUMENTS, MAX_FILE_BYTES, BoundedLoader
from kvbank.modelpool import SpecError, parse_modelpool

ROOT = Path(__file__).resolve().parents[2]
POOL = (ROOT / "examples" / "modelpool-llama-8b.yaml").read_text()
MEMORY_BYTES = 768 * 1024 * 1024  # a Python process with PyYAML needs about 40 MB
CPU_SECONDS = 20


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))


def check(path: Path) -> subprocess.CompletedProcess[str]:
    """`kvbank check PATH` in a process that dies past MEMORY_BYTES or CPU_SECONDS."""
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=_limit,
    )


def alias_bomb(levels: int = 9) -> str:
    """`levels` anchors, each a list of nine aliases of the one before: 9**levels values."""
    names = "abcdefghijklmnopqrstuvwxyz"
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in itertools.pairwise(names[:levels]):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def bomb_under_max_tokens(levels: int = 9) -> str:
    """The example pool with the bomb as limits.maxTokens, as an attacker would place it; the
    anchors sit in metadata.annotations, which the parser never reads."""
    last = "abcdefghijklmnopqrstuvwxyz"[levels - 1]
    anchors = "\n".join("    " + line for line in alias_bomb(levels).splitlines())
    text = POOL.replace(
        "metadata: {name: llama-8b, namespace: team-a}",
        f"metadata:\n  name: llama-8b\n  namespace: team-a\n  annotations:\n{anchors}",
    )
    limits = "limits: {maxSeqLen: 8192, maxTokens: 2048}"
    assert limits in text
    return text.replace(limits, f"limits:\n    maxSeqLen: 8192\n    maxTokens: *{last}")


class TestAliasBomb:
    def test_nine_levels_under_max_tokens_fail_fast_with_a_short_message(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "bomb.yaml"
        path.write_text(bomb_under_max_tokens(9))
        out = check(path)
        assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
        assert len(out.stderr) < 1000, len(out.stderr)
        assert "expands to more than" in out.stderr
        assert "Traceback" not in out.stderr

    def test_a_shared_value_is_quoted_within_the_limit(self) -> None:
        """The parser (the webhook's and the sidecar's too) quotes a bad value at a cost bounded
        by the quote: here 9**5 strings reached by sharing lists, under the size limit."""
        doc = yaml.load(POOL, Loader=BoundedLoader)
        value: object = ["lol"] * 9
        for _ in range(4):
            value = [value] * 9
        doc["spec"]["limits"]["maxTokens"] = value
        with pytest.raises(SpecError) as info:
            parse_modelpool(doc)
        message = str(info.value)
        assert "spec.limits.maxTokens: must be an integer from 1 to" in message
        assert len(message) < 200, message

    def test_the_parser_refuses_a_bomb_it_is_handed_before_walking_it(self) -> None:
        """What the webhook hands the parser never went through the YAML reader's limits."""
        doc = yaml.load(POOL, Loader=BoundedLoader)
        value: object = ["lol"] * 9
        for _ in range(8):
            value = [value] * 9
        doc["spec"]["limits"]["maxTokens"] = value
        with pytest.raises(SpecError) as info:
            parse_modelpool(doc)
        assert f"manifest: holds more than {MAX_VALUES} values" in str(info.value)

    def test_the_parser_refuses_deep_nesting_it_is_handed(self) -> None:
        doc = yaml.load(POOL, Loader=BoundedLoader)
        deep: object = 1
        for _ in range(5000):
            deep = [deep]
        doc["spec"]["extra"] = deep
        with pytest.raises(SpecError, match=f"nests deeper than {MAX_DEPTH} levels"):
            parse_modelpool(doc)

    def test_an_unknown_key_of_a_megabyte_is_cut_short(self) -> None:
        doc = yaml.load(POOL, Loader=BoundedLoader)
        doc["spec"]["x" * 1_000_000] = 1
        with pytest.raises(SpecError) as info:
            parse_modelpool(doc)
        assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("short", "'short'"),
        (10**5000, "<an integer of"),
        ("y" * 10_000, "'yyyy"),
        ({"k": list(range(100))}, "{'k': [0, 1, 2, 3, ...]}"),
    ],
    ids=["short", "huge-int", "long-string", "nested"],
)
def test_quote_is_bounded(value: object, shown: str) -> None:
    text = quote(value)
    assert len(text) <= QUOTE_LIMIT
    assert text.startswith(shown)


class TestUnreadableFiles:
    """Each documented as exit 2 with a message; before, each was a traceback (exit 1)."""

    def test_not_utf8(self, tmp_path: Path) -> None:
        path = tmp_path / "latin1.yaml"
        path.write_bytes(POOL.replace("team-a", "équipe").encode("latin-1"))
        out = check(path)
        assert out.returncode == 2, out.stderr
        assert "is not UTF-8" in out.stderr and "save it as UTF-8" in out.stderr
        assert "Traceback" not in out.stderr

    def test_utf16(self, tmp_path: Path) -> None:
        path = tmp_path / "utf16.yaml"
        path.write_bytes(POOL.encode("utf-16"))
        out = check(path)
        assert out.returncode == 2, out.stderr
        assert "is UTF-16-encoded; save it as UTF-8" in out.stderr

    def test_deep_nesting(self, tmp_path: Path) -> None:
        path = tmp_path / "deep.yaml"
        path.write_text("a: " + "[" * 20_000 + "]" * 20_000 + "\n")
        out = check(path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"nesting deeper than {MAX_DEPTH} levels" in out.stderr
        assert "Traceback" not in out.stderr

    def test_over_the_size_cap(self, tmp_path: Path) -> None:
        path = tmp_path / "big.yaml"
        padding = "# " + "x" * 98 + "\n"
        path.write_text(POOL + padding * (MAX_FILE_BYTES // len(padding) + 1))
        out = check(path)
        assert out.returncode == 2, out.stderr
        assert f"larger than the {MAX_FILE_BYTES // (1024 * 1024)} MiB" in out.stderr

    def test_too_many_documents(self, tmp_path: Path) -> None:
        path = tmp_path / "many.yaml"
        path.write_text("---\n".join([POOL] * (MAX_DOCUMENTS + 1)))
        out = check(path)
        assert out.returncode == 2, out.stderr[-500:]
        assert f"more than {MAX_DOCUMENTS} YAML documents" in out.stderr

    def test_an_integer_past_python_s_digit_limit(self, tmp_path: Path) -> None:
        path = tmp_path / "digits.yaml"
        path.write_text(POOL.replace("maxTokens: 2048", "maxTokens: " + "9" * 5000))
        out = check(path)
        assert out.returncode == 2, out.stderr[-500:]
        assert "a value cannot be read" in out.stderr and len(out.stderr) < 500


HUGE = "1" + "0" * 400  # past float's range: float() and math.isnan() overflow on it


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("memoryGiB: 80,", f"memoryGiB: {HUGE},", "spec.gpu.memoryGiB"),
        ("memoryUtilization: 0.9,", f"memoryUtilization: -{HUGE},", "spec.gpu.memoryUtilization"),
        ("parameters: 8.03e9,", f"parameters: {HUGE},", "spec.model.architecture.parameters"),
        ("maxTokens: 2048", "maxTokens: " + "9" * 4000, "spec.limits.maxTokens"),
    ],
)  # fmt: skip
def test_a_number_of_hundreds_of_digits_is_one_bounded_line_naming_its_field(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    assert old in POOL
    path = tmp_path / "pool.yaml"
    path.write_text(POOL.replace(old, new))
    out = check(path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    [line] = [line for line in out.stderr.splitlines() if line.startswith("  - ")]
    assert line.startswith(f"  - {field}: must be ")
    assert len(line) < 200  # the value quoted at a bounded length, not its digits


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (POOL.replace("  replicas: 2\n", "  replicas: 2\n  replicas: 0\n"),
         "key 'replicas' appears twice in one mapping, on line 15 and line 16"),
        (POOL.replace("kv: {pageSize: 16,", "kv: {pageSize: 16, pageSize: 32,"),
         "key 'pageSize' appears twice"),
    ],
)  # fmt: skip
def test_a_duplicate_key_is_refused_naming_it_and_its_lines(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    out = check(path)
    assert out.returncode == 2
    assert says in out.stderr and "kubectl refuses a duplicate key" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_merge_key_overridden_is_not_a_duplicate() -> None:
    doc = yaml.load("base: &b {x: 1, y: 2}\nover: {<<: *b, x: 3}\n", Loader=BoundedLoader)
    assert doc["over"] == {"x": 3, "y": 2}


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"name": "Llama_8B", "namespace": "team-a"}, "metadata.name"),
        ({"name": "8b-pool", "namespace": "team-a"}, "metadata.name"),  # its Services need a letter
        ({"name": "llama.8b", "namespace": "team-a"}, "metadata.name"),
        ({"name": "llama-", "namespace": "team-a"}, "metadata.name"),
        ({"name": "llama", "namespace": "Team A"}, "metadata.namespace"),
        ({"name": "llama", "namespace": "a" * 64}, "metadata.namespace"),
        ({"name": "llama", "namespace": 7}, "metadata.namespace"),
    ],
)  # fmt: skip
def test_metadata_names_must_be_kubernetes_names(meta: dict[str, object], field: str) -> None:
    doc = yaml.load(POOL, Loader=BoundedLoader)
    doc["metadata"] = meta
    with pytest.raises(SpecError) as caught:
        parse_modelpool(doc)
    [error] = caught.value.errors
    assert error.path == field
    assert "Kubernetes name" in error.message or "non-empty string" in error.message
    assert len(str(error)) < 300


def test_valid_metadata_names_pass() -> None:
    doc = yaml.load(POOL, Loader=BoundedLoader)
    for meta, namespace in [({"name": "l", "namespace": "9-team"}, "9-team"),
                            ({"name": "llama-8b"}, "default"),
                            ({"name": "a" + "-b" * 19, "namespace": ""}, "default")]:  # fmt: skip
        doc["metadata"] = meta
        pool = parse_modelpool(doc)
        assert (pool.name, pool.namespace) == (meta["name"], namespace)
