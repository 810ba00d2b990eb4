"""The weights volume's builder, one source at a time, and the scripts its init containers run,
run here by a real shell against real folders."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest

from kvbank.deployment import HuggingFaceSource, ImageSource, PvcSource, SecretKey
from kvbank.operator.render.names import RenderSettings
from kvbank.operator.render.weights import CHECK_SCRIPT, COPY_SCRIPT, weights

SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")


class TestWeightsVolume:
    def test_a_claim_is_mounted_read_only_where_model_looks(self) -> None:
        parts = weights(PvcSource("w", "llama"), SETTINGS, "llama-3.1-8b-instruct")
        assert parts.volume == {
            "name": "weights",
            "persistentVolumeClaim": {"claimName": "w", "readOnly": True},
        }
        assert parts.mount == {
            "name": "weights",
            "mountPath": "/models/llama-3.1-8b-instruct",
            "readOnly": True,
            "subPath": "llama",
        }
        [check] = parts.init_containers
        assert check["name"] == "weights-check" and check["volumeMounts"] == [parts.mount]
        assert check["terminationMessagePolicy"] == "FallbackToLogsOnError"

    def test_an_image_is_copied_by_an_init_container_running_that_image(self) -> None:
        parts = weights(ImageSource("registry.example/llama:1", "/m"), SETTINGS, "llama")
        assert parts.volume == {"name": "weights", "emptyDir": {}}
        copy, check = parts.init_containers
        assert copy["image"] == "registry.example/llama:1"
        assert copy["command"][-2:] == ["/m", "/kvbank-weights"]
        assert copy["volumeMounts"] == [{"name": "weights", "mountPath": "/kvbank-weights"}]
        assert check["image"] == SETTINGS.image

    def test_an_image_is_mounted_as_a_volume_where_the_cluster_has_them(self) -> None:
        settings = dataclasses.replace(SETTINGS, image_volumes=True)
        parts = weights(ImageSource("registry.example/llama:1", "/m/llama"), settings, "llama")
        assert parts.volume == {
            "name": "weights",
            "image": {"reference": "registry.example/llama:1", "pullPolicy": "IfNotPresent"},
        }
        assert parts.mount == {
            "name": "weights",
            "mountPath": "/models/llama",
            "readOnly": True,
            "subPath": "m/llama",
        }
        [check] = parts.init_containers  # no copy
        assert check["name"] == "weights-check"

    def test_a_hugging_face_download_takes_its_token_from_a_secret(self) -> None:
        source = HuggingFaceSource("meta-llama/Llama-3.1-8B", "main", SecretKey("hf", "token"))
        download, _ = weights(source, SETTINGS, "llama").init_containers
        env = {e["name"]: e for e in download["env"]}
        assert env["KVBANK_HF_REPO"]["value"] == "meta-llama/Llama-3.1-8B"
        assert env["KVBANK_HF_REVISION"]["value"] == "main"
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        # The repo travels by environment only, never into the code the container runs.
        assert "meta-llama" not in " ".join(download["command"])

    def test_no_source_checks_the_image_itself(self) -> None:
        parts = weights(None, SETTINGS, "llama")
        assert parts.volume is None and parts.mount is None
        [check] = parts.init_containers
        assert "volumeMounts" not in check


def _sh(script: str, *args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        ["/bin/sh", "-c", script, "name", *args],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )


class TestWeightsCheckScript:
    ENV: ClassVar[dict[str, str]] = {"KVBANK_WEIGHTS_SOURCE": "PersistentVolumeClaim w"}

    def test_a_checkpoint_passes(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "model.safetensors").write_bytes(b"\0")
        out = _sh(CHECK_SCRIPT, str(tmp_path), env=self.ENV)
        assert out.returncode == 0, out.stderr
        assert f"weights found in {tmp_path} (from PersistentVolumeClaim w)" in out.stdout

    @pytest.mark.parametrize(
        ("files", "expected"),
        [
            (None, "is not a readable folder"),
            ({}, "no readable config.json in"),
            ({"config.json": "{}"}, "no readable *.safetensors in"),
        ],
    )
    def test_what_is_missing_is_one_log_line(
        self, tmp_path: Path, files: dict[str, str] | None, expected: str
    ) -> None:
        folder = tmp_path / "model"
        if files is not None:
            folder.mkdir()
            for name, text in files.items():
                (folder / name).write_text(text)
        out = _sh(CHECK_SCRIPT, str(folder), env=self.ENV)
        assert out.returncode == 1
        assert out.stderr.startswith("kvbank: weights missing:")
        assert expected in out.stderr and "PersistentVolumeClaim w" in out.stderr

    def test_the_copy_brings_the_whole_folder(self, tmp_path: Path) -> None:
        source, target = tmp_path / "image", tmp_path / "weights"
        (source / "sub").mkdir(parents=True)
        target.mkdir()
        (source / "config.json").write_text("{}")
        (source / "sub" / "a.safetensors").write_text("x")
        assert _sh(COPY_SCRIPT, str(source), str(target)).returncode == 0
        assert (target / "sub" / "a.safetensors").read_text() == "x"
        missing = _sh(COPY_SCRIPT, str(tmp_path / "none"), str(target))
        assert missing.returncode == 1 and "the image has no folder" in missing.stderr
