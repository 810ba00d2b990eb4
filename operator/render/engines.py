"""The engine container's command line and environment, for either engine `spec.engine.kind`
names, and the sidecar's; the secrets both read (API keys, the sidecar's TLS) as mounts, and
the volume they share the sidecar's Unix socket in.

- `kvbank`: `kvbank serve` with the pool's own figures, so the engine admits by the same
  numbers the webhook judged (the pages resolved, memoryFraction included).
- `vllm`: `vllm serve` with kvbank's scheduler class, its block size and block count pinned to
  the pool's, so vLLM's KV manager holds exactly the pages kvbank's ledger promises; the class
  reads its policy and sidecar from the environment. vLLM runs its tensor-parallel ranks
  itself, inside one pod, so a vLLM pool's group is one pod with all its GPUs. A pool that asks
  for no GPU (`spec.template.resources.gpusPerRank: 0`) runs vLLM's CPU build: it is told so
  (`VLLM_TARGET_DEVICE=cpu`) and given its KV cache in bytes (`--kv-cache-memory-bytes`, the
  pool's pages at their page size), since on CPU vLLM would otherwise reserve
  `--gpu-memory-utilization` of the node's memory and refuse to start when that is not free.
  kvbank's own engine needs neither: it takes CUDA when torch sees it, else the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbank.capacity import pool_pages
from kvbank.capacity.holdability import page_bytes
from kvbank.deployment import Deployment, PodTemplate, SecretKey
from kvbank.modelpool import Admission, ModelPool
from kvbank.operator.render.names import CONFIG_DIR, POOL_FILE, RenderSettings
from kvbank.operator.render.token import TOKEN_FILE
from kvbank.operator.render.weights import model_path

API_KEY_DIR = "/etc/kvbank/api-key"
API_KEY_VOLUME = "api-key"
TLS_DIR = "/etc/kvbank/sidecar-tls"
TLS_VOLUME = "sidecar-tls"
TLS_CA_FILE = f"{TLS_DIR}/ca.crt"
# The engine reaches its sidecar on a Unix socket, which only the pod's own containers can
# open; the pod address stays for the operator's status reads and the probes. The root
# filesystem is read-only, so the socket lives in an emptyDir both containers mount (the pod's
# fsGroup makes it theirs; a socket a killed sidecar left there is taken over at its restart).
SOCKET_VOLUME = "sidecar-socket"
SOCKET_DIR = "/var/run/kvbank/sidecar"
SIDECAR_SOCKET = f"unix://{SOCKET_DIR}/admission.sock"
# A socket has no host name for TLS to check: gRPC takes its path for one. The pool's
# certificate names localhost (render.sidecar_tls), so the engine checks that name.
SOCKET_TLS_NAME = "localhost"
VLLM_SCHEDULER = "kvbank.vllm.KvbankScheduler"
# The label Gateway API inference gateways read a pod's engine from (the Inference Extension's
# model-server protocol: which metric names to scrape); a vLLM pod exports vLLM's own.
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
API_KEY_FILE_ENV = "KVBANK_API_KEY_FILE"
# vLLM takes several keys only as the words after one `--api-key` (a second `--api-key`
# replaces the first; VLLM_API_KEY is one key, the Secret's whole value, newlines included).
# So the keys are read here from the mounted Secret, one a line with blank lines and `#`
# comments skipped as `kvbank serve --api-key-file` reads them, and appended to vLLM's
# command: they reach its argv inside the container, never the pod spec. `$@` is the command.
VLLM_KEYS_SCRIPT = """set -eu
file="$KVBANK_API_KEY_FILE"
keys=0
set -- "$@" --api-key
while IFS= read -r line || [ -n "$line" ]; do
  key="$(printf '%s' "$line" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')"
  case "$key" in ''|'#'*) continue ;; esac
  set -- "$@" "$key"
  keys=$((keys + 1))
done < "$file"
if [ "$keys" -eq 0 ]; then
  echo "kvbank: $file holds no API key (spec.apiKeySecret): write one key a line" >&2
  exit 2
fi
exec "$@"
"""


@dataclass(frozen=True)
class EngineCommand:
    image: str
    args: list[str]
    env: list[dict[str, Any]]


def is_vllm(deployment: Deployment) -> bool:
    return deployment.engine.kind == "vllm"


def ranks_per_pod(pool: ModelPool, deployment: Deployment) -> int:
    """How many tensor-parallel ranks one pod runs: all of a group's under vLLM, else one."""
    return pool.tensor_parallel if is_vllm(deployment) else 1


def pods_per_group(pool: ModelPool, deployment: Deployment) -> int:
    return pool.tensor_parallel // ranks_per_pod(pool, deployment)


def on_cpu(template: PodTemplate) -> bool:
    """The pool asks its nodes for no GPU (gpusPerRank 0, the pool's or the chart's default)."""
    return template.gpus_per_rank == 0


def engine_labels(deployment: Deployment) -> dict[str, str]:
    """The pod labels that say which engine serves (only vLLM's is one gateways know)."""
    return {ENGINE_TYPE_LABEL: "vllm"} if is_vllm(deployment) else {}


def engine_sidecar_address(settings: RenderSettings, deployment: Deployment) -> str:
    """Where the engine calls its sidecar: the Unix socket in the volume both containers mount,
    for kvbank's engine (`--sidecar`) and vLLM's plug-in (`KVBANK_SIDECAR`) alike."""
    return SIDECAR_SOCKET


def kvbank_args(pool: ModelPool, settings: RenderSettings, deployment: Deployment, tls: bool):
    args = [
        "kvbank", "serve",
        "--host", "0.0.0.0",
        "--port", str(settings.http_port),
        "--sidecar", engine_sidecar_address(settings, deployment),
        "--sidecar-token-file", TOKEN_FILE,
        "--model", model_path(settings, pool.model_name),
        "--pages", str(pool_pages(pool)),
        "--page-size", str(pool.kv.page_size),
        "--max-seq-len", str(pool.limits.max_seq_len),
        "--max-tokens", str(pool.limits.max_tokens),
        "--policy", pool.admission.ledger_policy,
    ]  # fmt: skip
    if tls:
        args += ["--sidecar-ca-file", TLS_CA_FILE, "--sidecar-tls-server-name", SOCKET_TLS_NAME]
    if deployment.api_key is not None:
        args += ["--api-key-file", f"{API_KEY_DIR}/{deployment.api_key.key}"]
    return [*args, *host_tier_args(pool), *class_args(pool.admission), *deployment.engine.args]


def host_tier_args(pool: ModelPool) -> list[str]:
    return ["--host-pages", str(pool.kv.host_pages)] if pool.kv.host_pages else []


def class_args(admission: Admission) -> list[str]:
    """The class flags whose values differ from `kvbank serve`'s own defaults (which are the
    spec's): a pool that sets none keeps its command, so an operator upgrade rolls no pod."""
    args = []
    if admission.default_class is not Admission.default_class:
        args += ["--default-class", admission.default_class.value]
    if admission.max_preemptions != Admission.max_preemptions:
        args += ["--max-preemptions", str(admission.max_preemptions)]
    if admission.victim is not Admission.victim:
        args += ["--victim", admission.victim.value]
    if admission.estimate is not Admission.estimate:
        args += ["--estimate", admission.estimate.value]
    return args


def vllm_args(
    pool: ModelPool, settings: RenderSettings, deployment: Deployment, cpu: bool = False
) -> list[str]:
    """Served under the spec's model name (what kvbank's engine answers to and clients send),
    and told the spec's memory fraction, which the pool's pages were sized by. `cpu`: the
    pool's KV cache is given in bytes, exactly its pages (the block count is pinned anyway)."""
    keys = ["/bin/sh", "-c", VLLM_KEYS_SCRIPT, "vllm-api-keys"] if deployment.api_key else []
    memory = ["--kv-cache-memory-bytes", str(pool_pages(pool) * page_bytes(pool))] if cpu else []
    return [
        *keys,
        "vllm", "serve", model_path(settings, pool.model_name),
        "--served-model-name", pool.model_name,
        "--gpu-memory-utilization", str(pool.gpu.memory_utilization),
        "--scheduler-cls", VLLM_SCHEDULER,  # vLLM's default scheduling, async included
        "--block-size", str(pool.kv.page_size),
        "--num-gpu-blocks-override", str(pool_pages(pool)),
        "--max-model-len", str(pool.limits.max_seq_len),
        "--port", str(settings.http_port),
        "--tensor-parallel-size", str(pool.tensor_parallel),
        *configured_args(pool),
        *memory,
        *deployment.engine.args,
    ]  # fmt: skip


def configured_args(pool: ModelPool) -> list[str]:
    """A fromConfig pool's step budget sizes its windows' and chunks' pages, and its KV dtype
    its page bytes: both pinned, so vLLM runs the layout judged."""
    if pool.from_config is None:
        return []
    args = ["--max-num-batched-tokens", str(pool.limits.max_num_batched_tokens)]
    if pool.from_config.kv_dtype.startswith("fp8"):  # 16-bit: vLLM's auto, the model's dtype
        args += ["--kv-cache-dtype", pool.from_config.kv_dtype]
    return args


def vllm_env(
    pool: ModelPool, settings: RenderSettings, deployment: Deployment, tls: bool, cpu: bool = False
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "VLLM_TARGET_DEVICE", "value": "cpu"}] if cpu else []
    env += [
        {"name": "KVBANK_POLICY", "value": pool.admission.ledger_policy},
        {"name": "KVBANK_SIDECAR", "value": engine_sidecar_address(settings, deployment)},
        {"name": "KVBANK_SIDECAR_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "KVBANK_DEFAULT_CLASS", "value": pool.admission.default_class.value},
        {"name": "KVBANK_MAX_PREEMPTIONS", "value": str(pool.admission.max_preemptions)},
        {"name": "KVBANK_ORDER", "value": pool.admission.order},
    ]
    if tls:
        env.append({"name": "KVBANK_SIDECAR_CA_FILE", "value": TLS_CA_FILE})
    if deployment.api_key is not None:
        env.append({"name": API_KEY_FILE_ENV, "value": f"{API_KEY_DIR}/{deployment.api_key.key}"})
    return env


def engine_command(
    pool: ModelPool, settings: RenderSettings, deployment: Deployment, tls: bool
) -> EngineCommand:
    if is_vllm(deployment):
        cpu = on_cpu(deployment.template.over(settings.template_defaults))
        return EngineCommand(
            deployment.engine.image or settings.vllm_image,
            vllm_args(pool, settings, deployment, cpu),
            vllm_env(pool, settings, deployment, tls, cpu),
        )
    return EngineCommand(
        deployment.engine.image or settings.image, kvbank_args(pool, settings, deployment, tls), []
    )


def sidecar_args(settings: RenderSettings, tls: bool) -> list[str]:
    """`kvbank sidecar` on the pod address, so the operator can read its status and the kubelet
    probe it, and on the socket its engine calls (every engine kind: one sidecar command). The
    pod address needs the shared token, which its engine sends too (--sidecar-token-file). With
    the pool's certificate it serves TLS, on the socket too, as it did on loopback (the engine
    checks the name `localhost` there); without one (no operator CA) the network must be
    trusted."""
    args = [
        "kvbank", "sidecar",
        "--listen", f"0.0.0.0:{settings.sidecar_port}",
        "--listen", SIDECAR_SOCKET,
        "--token-file", TOKEN_FILE,
        "--metrics-port", str(settings.metrics_port),
        "--metrics-host", "0.0.0.0",
        "--pool", f"{CONFIG_DIR}/{POOL_FILE}",
    ]  # fmt: skip
    if tls:
        return [
            *args,
            "--tls-cert-file",
            f"{TLS_DIR}/tls.crt",
            "--tls-key-file",
            f"{TLS_DIR}/tls.key",
        ]
    return [*args, "--trusted-network"]


def api_key_volume(key: SecretKey) -> dict[str, Any]:
    return {
        "name": API_KEY_VOLUME,
        "secret": {"secretName": key.name, "items": [{"key": key.key, "path": key.key}]},
    }


def api_key_mount() -> dict[str, Any]:
    return {"name": API_KEY_VOLUME, "mountPath": API_KEY_DIR, "readOnly": True}


def tls_volume(secret_name: str) -> dict[str, Any]:
    return {"name": TLS_VOLUME, "secret": {"secretName": secret_name}}


def tls_mount() -> dict[str, Any]:
    return {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}


def socket_volume() -> dict[str, Any]:
    # Holds one socket and nothing else.
    return {"name": SOCKET_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}}


def socket_mount() -> dict[str, Any]:
    return {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}
