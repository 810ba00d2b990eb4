"""The weights volume: where `spec.model.source` puts the model folder, mounted read-only at
MODEL_ROOT/<model name>, the folder `--model` names.

- `pvc` and `hostPath` are mounted as they are (`subPath` picks a folder of the claim);
- `image` is mounted as an image volume where the cluster has them (`--image-volumes`), else
  copied by an init container, running that image, into an emptyDir, so any registry-served
  image that holds the folder works without image-volume support;
- `huggingFace` is downloaded by an init container (the engine image, which carries
  huggingface_hub) into an emptyDir, with the token from a Secret when the repo is gated.

Whatever the source, a last init container checks the folder the engine will read and stops
the pod with one log line naming what is missing, instead of an engine that fails deep in its
loader. With no source the image itself must hold the weights at that path (the default).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Any

from kvbank.deployment import (
    HostPathSource,
    HuggingFaceSource,
    ImageSource,
    PvcSource,
    Source,
)
from kvbank.operator.render.names import RenderSettings
from kvbank.operator.render.security import CHECK_RESOURCES, COPY_RESOURCES, DOWNLOAD_RESOURCES

WEIGHTS_VOLUME = "weights"
STAGING = "/kvbank-weights"  # where init containers write an emptyDir's copy
CHECK_CONTAINER = "weights-check"

# The model folder is a Hugging Face checkpoint: config.json and safetensors shards. `$1` is
# the folder; KVBANK_WEIGHTS_SOURCE says where it came from, for the log line.
CHECK_SCRIPT = """set -u
dir="$1"
if [ ! -d "$dir" ] || [ ! -x "$dir" ]; then
  echo "kvbank: weights missing: $dir is not a readable folder (from $KVBANK_WEIGHTS_SOURCE)" >&2
  exit 1
fi
if [ ! -r "$dir/config.json" ]; then
  echo "kvbank: weights missing: no readable config.json in $dir" \
    "(from $KVBANK_WEIGHTS_SOURCE); the folder must hold a Hugging Face checkpoint:" \
    "config.json, tokenizer files, *.safetensors" >&2
  exit 1
fi
for shard in "$dir"/*.safetensors; do
  if [ -r "$shard" ]; then
    echo "kvbank: weights found in $dir (from $KVBANK_WEIGHTS_SOURCE)"
    exit 0
  fi
done
echo "kvbank: weights missing: no readable *.safetensors in $dir (from $KVBANK_WEIGHTS_SOURCE)" >&2
exit 1
"""

COPY_SCRIPT = """set -eu
if [ ! -d "$1" ]; then
  echo "kvbank: weights missing: the image has no folder $1 (spec.model.source.image.path)" >&2
  exit 1
fi
cp -R "$1"/. "$2"/
"""

# Arguments through the environment, never spliced into the code.
DOWNLOAD_CODE = (
    "import os\n"
    "from huggingface_hub import snapshot_download\n"
    "snapshot_download(os.environ['KVBANK_HF_REPO'], revision=os.environ.get('KVBANK_HF_REVISION')"
    " or None, local_dir=os.environ['KVBANK_WEIGHTS_DIR'])\n"
)


@dataclass(frozen=True)
class WeightsParts:
    """What the source adds to a rank's pod: `mount` goes into the engine container."""

    volume: dict[str, Any] | None
    init_containers: list[dict[str, Any]]
    mount: dict[str, Any] | None


def model_path(settings: RenderSettings, model_name: str) -> str:
    return f"{settings.model_root}/{model_name}"


def describe(source: Source | None) -> str:
    """The source in the words of the spec, for log lines and conditions."""
    if isinstance(source, PvcSource):
        sub = f" (subPath {source.sub_path})" if source.sub_path else ""
        return f"PersistentVolumeClaim {source.claim_name}{sub}"
    if isinstance(source, HostPathSource):
        return f"hostPath {source.path}"
    if isinstance(source, ImageSource):
        return f"image {source.reference}:{source.path}"
    if isinstance(source, HuggingFaceSource):
        return f"Hugging Face {source.repo}@{source.revision or 'main'}"
    return "the engine image (no spec.model.source)"


def _staging_mount() -> dict[str, Any]:
    return {"name": WEIGHTS_VOLUME, "mountPath": STAGING}


def _copy(source: ImageSource, settings: RenderSettings) -> dict[str, Any]:
    return {
        "name": "weights-copy",
        "image": source.reference,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["/bin/sh", "-c", COPY_SCRIPT, "weights-copy", source.path, STAGING],
        "volumeMounts": [_staging_mount()],
        "resources": deepcopy(COPY_RESOURCES),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _download(source: HuggingFaceSource, settings: RenderSettings) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "KVBANK_HF_REPO", "value": source.repo},
        {"name": "KVBANK_WEIGHTS_DIR", "value": STAGING},
        {"name": "HF_HOME", "value": f"{STAGING}/.cache"},
    ]
    if source.revision:
        env.append({"name": "KVBANK_HF_REVISION", "value": source.revision})
    if source.token is not None:
        ref = {"name": source.token.name, "key": source.token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return {
        "name": "weights-download",
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-c", DOWNLOAD_CODE],
        "env": env,
        "volumeMounts": [_staging_mount()],
        "resources": deepcopy(DOWNLOAD_RESOURCES),
    }


def check_container(
    source: Source | None, settings: RenderSettings, model_name: str, mount: dict[str, Any] | None
) -> dict[str, Any]:
    folder = model_path(settings, model_name)
    container: dict[str, Any] = {
        "name": CHECK_CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["/bin/sh", "-c", CHECK_SCRIPT, CHECK_CONTAINER, folder],
        "env": [{"name": "KVBANK_WEIGHTS_SOURCE", "value": describe(source)}],
        "resources": deepcopy(CHECK_RESOURCES),
        # Its log line becomes the pod's termination message, which the live timer turns into
        # the pool's WeightsAvailable condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if mount is not None:
        container["volumeMounts"] = [mount]
    return container


def weights(source: Source | None, settings: RenderSettings, model_name: str) -> WeightsParts:
    read_only: dict[str, Any] = {
        "name": WEIGHTS_VOLUME,
        "mountPath": model_path(settings, model_name),
        "readOnly": True,
    }
    mount: dict[str, Any] | None = read_only
    volume: dict[str, Any] | None
    init: list[dict[str, Any]] = []
    if isinstance(source, PvcSource):
        volume = {
            "name": WEIGHTS_VOLUME,
            "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True},
        }
        if source.sub_path:
            mount = {**read_only, "subPath": source.sub_path}
    elif isinstance(source, HostPathSource):
        # Directory, not DirectoryOrCreate: a missing path stops the pod, it is never made empty.
        volume = {"name": WEIGHTS_VOLUME, "hostPath": {"path": source.path, "type": "Directory"}}
    elif isinstance(source, ImageSource) and settings.image_volumes:
        # The kubelet mounts the image itself, read-only: nothing is copied at start.
        image = {"reference": source.reference, "pullPolicy": settings.image_pull_policy}
        volume = {"name": WEIGHTS_VOLUME, "image": image}
        inside = source.path.strip("/")
        if inside:
            mount = {**read_only, "subPath": inside}
    elif isinstance(source, ImageSource):
        volume = {"name": WEIGHTS_VOLUME, "emptyDir": {}}
        init.append(_copy(source, settings))
    elif isinstance(source, HuggingFaceSource):
        volume = {"name": WEIGHTS_VOLUME, "emptyDir": {}}
        init.append(_download(source, settings))
    else:
        volume, mount = None, None
    init.append(check_container(source, settings, model_name, mount))
    return WeightsParts(volume, init, mount)
