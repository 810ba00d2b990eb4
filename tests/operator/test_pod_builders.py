"""The builders of a rank pod's pod-facing parts, one class each: the spec's reader, the weights
volume (its check script run by a real shell), scheduling, the engine's command line for either
engine, the sidecar's TLS, and the whole pod template they compose, with the socket its engine
and sidecar share."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from operator_specs import pool_doc

from kvbank.deployment import (
    Deployment,
    Engine,
    PodTemplate,
    PvcSource,
    Resources,
    SecretKey,
    parse_deployment,
    parse_template,
)
from kvbank.modelpool import SpecError, parse_modelpool
from kvbank.operator.render.engines import (
    SOCKET_VOLUME,
    VLLM_KEYS_SCRIPT,
    engine_command,
    sidecar_args,
)
from kvbank.operator.render.names import Owner, RenderSettings, Workload
from kvbank.operator.render.pods import pod_template
from kvbank.operator.render.scheduling import engine_resources, placement, shm_volume
from kvbank.operator.render.sidecar_tls import PoolTLS, pool_tls_names, tls_secret
from kvbank.operator.render.workloads import stateful_set
from kvbank.sidecar.server import UNIX_PATH_MAX
from kvbank.vllm.settings import from_env

SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken")
OWNER = Owner("llama", "team-a", "uid-7")
TOKEN_SECRET = "llama-sidecar-token-0123456789"


def errors_of(parse: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse()
    return [str(e) for e in caught.value.errors]


def _deployment(**spec: Any) -> Deployment:
    return parse_deployment(pool_doc(**spec))


def _errors(**spec: Any) -> list[str]:
    return errors_of(lambda: parse_deployment(pool_doc(**spec)))


def _model(source: Any) -> dict[str, Any]:
    return {
        "name": "llama-3.1-8b-instruct",
        "architecture": {"preset": "llama-3.1-8b"},
        "source": source,
    }


class TestParseDeployment:
    def test_reads_every_field(self) -> None:
        got = _deployment(
            model=_model({"pvc": {"claimName": "weights", "subPath": "llama"}}),
            template={
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "priorityClassName": "inference",
                "imagePullSecrets": [{"name": "regcred"}],
                "resources": {"gpusPerRank": 2, "cpu": 8, "memory": "64Gi"},
                "shmSize": "16Gi",
            },
            engine={"kind": "vllm", "args": ["--enforce-eager"]},
            apiKeySecret={"name": "keys"},
        )
        assert got.source == PvcSource("weights", "llama")
        assert got.template.node_selector == {"gpu": "h100"}
        assert got.template.image_pull_secrets == ("regcred",)
        assert got.template.resources == Resources(2, "8", "64Gi")
        assert got.engine == Engine("vllm", None, ("--enforce-eager",))
        assert got.api_key == SecretKey("keys", "api-key")

    def test_none_given_is_the_default_deployment(self) -> None:
        assert _deployment() == Deployment()

    @pytest.mark.parametrize(
        ("spec", "expected"),
        [
            (
                {"model": _model({})},
                "spec.model.source: set exactly one of pvc, hostPath, image, huggingFace; got none",
            ),
            (
                {"model": _model({"pvc": {"claimName": "a"}, "image": {"reference": "r"}})},
                "set exactly one of pvc, hostPath, image, huggingFace; got pvc, image",
            ),
            (
                {"model": _model({"pvc": {"claimName": "Weights_1"}})},
                "spec.model.source.pvc.claimName: must be a Kubernetes object name",
            ),
            (
                {"model": _model({"pvc": {"claimName": "w", "subPath": "../etc"}})},
                "subPath: must be a path inside the volume (relative, no '..')",
            ),
            (
                {"model": _model({"hostPath": {"path": "models"}})},
                "spec.model.source.hostPath.path: must be an absolute path",
            ),
            (
                {"model": _model({"image": {"reference": "bad ref"}})},
                "reference: must be an image reference with no spaces",
            ),
            (
                {"model": _model({"huggingFace": {"repo": "a/b/c"}})},
                "spec.model.source.huggingFace.repo: must be a repository id",
            ),
            ({"template": {"nodeSelector": {"gpu": 1}}}, "must map label keys to string values"),
            (
                {"template": {"tolerations": [{"operator": "Exists", "value": "x"}]}},
                "spec.template.tolerations[0].value: must be empty with operator Exists",
            ),
            (
                {"template": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}},
                "tolerationSeconds: applies only with effect NoExecute",
            ),
            (
                {"template": {"topologySpreadConstraints": [{"topologyKey": "zone"}]}},
                "spec.template.topologySpreadConstraints[0].maxSkew: is missing",
            ),
            (
                {"template": {"affinity": {"nodeAfinity": {}}}},
                "spec.template.affinity.nodeAfinity: is not a known field",
            ),
            (
                {"template": {"resources": {"gpusPerRank": 17}}},
                "spec.template.resources.gpusPerRank: must be from 0 to 16, got 17",
            ),
            (
                {"template": {"resources": {"memory": "lots"}}},
                "spec.template.resources.memory: must be a Kubernetes quantity",
            ),
            ({"template": {"shmSize": "16GB"}}, "spec.template.shmSize: must be a Kubernetes"),
            ({"engine": {"kind": "sglang"}}, "spec.engine.kind: must be one of kvbank, vllm"),
            (
                {"engine": {"kind": "vllm", "args": ["--max-model-len=4096"]}},
                "spec.engine.args[0]: sets --max-model-len, which the operator renders",
            ),
            (
                {"engine": {"args": ["--pages", "9"]}},
                "spec.engine.args[0]: sets --pages, which the operator renders",
            ),
            ({"apiKeySecret": {"name": "k", "key": "a/b"}}, "spec.apiKeySecret.key: must be a"),
        ],
    )
    def test_bad_input_names_the_field_and_what_to_write(
        self, spec: dict[str, Any], expected: str
    ) -> None:
        errors = _errors(**spec)
        assert any(expected in e for e in errors), errors

    def test_every_problem_at_once(self) -> None:
        errors = _errors(template={"shmSize": "x", "resources": {"cpu": "y"}}, engine={"kind": "z"})
        assert len(errors) == 3


class TestPodTemplateDefaults:
    def test_the_pools_fields_win_field_by_field_and_resources_key_by_key(self) -> None:
        defaults = parse_template(
            {
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "priorityClassName": "default-class",
                "resources": {"cpu": "4", "memory": "32Gi"},
            },
            "pools.template",
        )
        mine = parse_template({"priorityClassName": "mine", "resources": {"cpu": "8"}})
        got = mine.over(defaults)
        assert got.priority_class_name == "mine"
        assert got.tolerations == ({"key": "gpu", "operator": "Exists"},)
        assert got.resources == Resources(None, "8", "32Gi")
        assert got.gpus_per_rank == 1  # unset anywhere: one GPU per rank

    def test_a_bad_default_names_the_charts_field(self) -> None:
        errors = errors_of(lambda: parse_template({"shmSize": "x"}, "pools.template"))
        assert errors[0].startswith("pools.template.shmSize: must be a Kubernetes quantity")


class TestScheduling:
    TEMPLATE = parse_template(
        {
            "nodeSelector": {"gpu": "h100"},
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
            ],
            "runtimeClassName": "nvidia",
            "imagePullSecrets": [{"name": "regcred"}],
            "resources": {"cpu": "8", "memory": "64Gi"},
            "shmSize": "16Gi",
        }
    )

    def test_placement_speaks_the_pod_specs_words(self) -> None:
        spec = placement(self.TEMPLATE, "llama")
        assert spec["nodeSelector"] == {"gpu": "h100"}
        assert spec["runtimeClassName"] == "nvidia"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        # No selector given: the pool's own pods are spread.
        assert spec["topologySpreadConstraints"][0]["labelSelector"] == {
            "matchLabels": {"app.kubernetes.io/name": "kvbank", "kvbank.dev/pool": "llama"}
        }
        assert placement(PodTemplate(), "llama") == {}

    def test_gpus_are_limits_cpu_and_memory_requests_memory_a_limit_too(self) -> None:
        assert engine_resources(self.TEMPLATE, SETTINGS, 2) == {
            "requests": {"cpu": "8", "memory": "64Gi"},
            "limits": {"memory": "64Gi", "nvidia.com/gpu": 2},
        }
        assert engine_resources(PodTemplate(), SETTINGS, 0) == {}  # a CPU pool

    def test_shm_is_an_in_memory_empty_dir(self) -> None:
        assert shm_volume(self.TEMPLATE) == {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"},
        }
        assert shm_volume(PodTemplate()) is None


class TestEngineCommand:
    def test_kvbank_serve_gains_the_ca_and_the_api_key_file(self) -> None:
        pool = parse_modelpool(pool_doc())
        deployment = _deployment(apiKeySecret={"name": "keys", "key": "k"}, engine={"args": ["-v"]})
        command = engine_command(pool, SETTINGS, deployment, tls=True)
        assert command.image == SETTINGS.image and command.env == []
        args = command.args
        assert args[args.index("--sidecar-ca-file") + 1] == "/etc/kvbank/sidecar-tls/ca.crt"
        # Its sidecar is on a socket, which carries no host name: the certificate's localhost.
        assert args[args.index("--sidecar-tls-server-name") + 1] == "localhost"
        assert args[args.index("--api-key-file") + 1] == "/etc/kvbank/api-key/k"
        assert args[-1] == "-v"

    def test_vllm_serve_is_the_interfaces_command_line_and_environment(self) -> None:
        pool = parse_modelpool(pool_doc(tensorParallel=2))
        deployment = _deployment(engine={"kind": "vllm", "args": ["--enforce-eager"]})
        command = engine_command(pool, SETTINGS, deployment, tls=True)
        assert command.image == SETTINGS.vllm_image
        assert command.args == [
            "vllm", "serve", "/models/llama-3.1-8b-instruct",
            "--served-model-name", "llama-3.1-8b-instruct", "--gpu-memory-utilization", "0.9",
            "--scheduler-cls", "kvbank.vllm.KvbankScheduler", "--block-size", "16",
            "--num-gpu-blocks-override", "20000",
            "--max-model-len", "8192", "--port", "8000", "--tensor-parallel-size", "2",
            "--enforce-eager",
        ]  # fmt: skip
        assert command.env == [
            {"name": "KVBANK_POLICY", "value": "peak+backfill"},
            {"name": "KVBANK_SIDECAR", "value": "unix:///var/run/kvbank/sidecar/admission.sock"},
            {"name": "KVBANK_SIDECAR_TOKEN_FILE", "value": "/var/run/kvbank/sidecar-token/token"},
            {"name": "KVBANK_DEFAULT_CLASS", "value": "strict"},
            {"name": "KVBANK_MAX_PREEMPTIONS", "value": "2"},
            {"name": "KVBANK_ORDER", "value": "fifo"},
            {"name": "KVBANK_SIDECAR_CA_FILE", "value": "/etc/kvbank/sidecar-tls/ca.crt"},
        ]

    def test_a_vllm_pool_that_asks_for_no_gpu_is_told_cpu_and_its_kv_bytes(self) -> None:
        """gpusPerRank 0: vLLM's CPU build, its KV cache exactly the pool's pages (on CPU it
        would otherwise reserve --gpu-memory-utilization of the node's memory)."""
        pool = parse_modelpool(pool_doc(kv={"pageSize": 16, "pages": 256}))
        deployment = _deployment(
            engine={"kind": "vllm"}, template={"resources": {"gpusPerRank": 0}}
        )
        command = engine_command(pool, SETTINGS, deployment, tls=False)
        args = command.args
        # llama-3.1-8b: 32 layers, 8 KV heads of 128, bfloat16; K and V; 16 tokens a page.
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(
            256 * 2 * 32 * 8 * 128 * 2 * 16
        )
        assert args[args.index("--num-gpu-blocks-override") + 1] == "256"
        assert command.env[0] == {"name": "VLLM_TARGET_DEVICE", "value": "cpu"}
        # A chart default of 0 GPUs is the same ask; a GPU pool gets neither.
        cpu_default = replace(
            SETTINGS, template_defaults=PodTemplate(resources=Resources(gpus_per_rank=0))
        )
        assert (
            "--kv-cache-memory-bytes"
            in engine_command(pool, cpu_default, _deployment(engine={"kind": "vllm"}), False).args
        )
        gpu = engine_command(pool, SETTINGS, _deployment(engine={"kind": "vllm"}), tls=False)
        assert "--kv-cache-memory-bytes" not in gpu.args
        assert "VLLM_TARGET_DEVICE" not in {e["name"] for e in gpu.env}

    def test_vllm_pods_carry_the_engine_type_label_gateways_read(self) -> None:
        pool = parse_modelpool(pool_doc())
        for deployment, label in (
            (_deployment(engine={"kind": "vllm"}), "vllm"),
            (Deployment(), None),
        ):
            template = pod_template(
                pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET, deployment
            )
            assert (
                template["metadata"]["labels"].get("inference.networking.k8s.io/engine-type")
                == label
            )
            # No VLLM_PORT=tcp://... from a Service named vllm: vLLM refuses to start on it.
            assert template["spec"].get("enableServiceLinks", True) is (label is None)

    def test_vllm_gets_every_key_of_the_secret_after_one_api_key_flag(self) -> None:
        pool = parse_modelpool(pool_doc())
        deployment = _deployment(engine={"kind": "vllm"}, apiKeySecret={"name": "keys"})
        command = engine_command(pool, SETTINGS, deployment, tls=False)
        assert command.args[:4] == ["/bin/sh", "-c", VLLM_KEYS_SCRIPT, "vllm-api-keys"]
        assert command.args[4:6] == ["vllm", "serve"]
        assert {"name": "KVBANK_API_KEY_FILE", "value": "/etc/kvbank/api-key/api-key"} in (
            command.env
        )
        assert "VLLM_API_KEY" not in str(command.env)  # one key only, the Secret's whole value

    @pytest.mark.parametrize(
        ("text", "keys"),
        [
            ("k1\n", ["k1"]),
            ("k1\nk2\n", ["k1", "k2"]),
            ("# rotated 2026-01\n  k1  \n\nk2", ["k1", "k2"]),  # comments, blanks, no last \n
            ("k1\r\nk2\r\n", ["k1", "k2"]),
        ],
    )
    def test_the_key_script_reads_lines_as_kvbank_serve_does(
        self, tmp_path: Path, text: str, keys: list[str]
    ) -> None:
        (tmp_path / "api-key").write_text(text)
        run = subprocess.run(
            ["sh", "-c", VLLM_KEYS_SCRIPT, "vllm-api-keys", "printf", "%s\\n", "vllm", "serve"],
            env={"KVBANK_API_KEY_FILE": str(tmp_path / "api-key"), "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        )
        assert run.stdout.splitlines() == ["vllm", "serve", "--api-key", *keys]

    def test_the_key_script_stops_on_a_secret_without_a_key(self, tmp_path: Path) -> None:
        (tmp_path / "api-key").write_text("# none yet\n\n")
        run = subprocess.run(
            ["sh", "-c", VLLM_KEYS_SCRIPT, "vllm-api-keys", "true"],
            env={"KVBANK_API_KEY_FILE": str(tmp_path / "api-key"), "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
        )
        assert run.returncode == 2
        assert "holds no API key (spec.apiKeySecret): write one key a line" in run.stderr

    def test_the_sidecar_serves_tls_or_is_told_the_network_is_trusted(self) -> None:
        with_tls = sidecar_args(SETTINGS, tls=True)
        assert with_tls[-4:] == [
            "--tls-cert-file", "/etc/kvbank/sidecar-tls/tls.crt",
            "--tls-key-file", "/etc/kvbank/sidecar-tls/tls.key",
        ]  # fmt: skip
        assert sidecar_args(SETTINGS, tls=False)[-1] == "--trusted-network"


class TestSidecarCertificateSecret:
    def test_covers_loopback_and_every_pod_of_either_workload(self) -> None:
        names = pool_tls_names(OWNER)
        assert {"localhost", "127.0.0.1", "*.llama-ranks.team-a.svc", "*.llama.team-a.svc"} <= set(
            names
        )

    def test_is_a_tls_secret_owned_by_the_pool(self) -> None:
        secret = tls_secret(OWNER, b"cert", b"key", b"ca")
        assert secret["metadata"]["name"] == "llama-sidecar-tls"
        assert secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        assert secret["metadata"]["ownerReferences"] == [OWNER.reference()]


class TestPodTemplateWithDeployment:
    def test_volumes_mounts_and_annotations_for_every_part(self) -> None:
        pool = parse_modelpool(pool_doc())
        deployment = _deployment(
            model=_model({"pvc": {"claimName": "w"}}),
            template={"shmSize": "1Gi", "nodeSelector": {"gpu": "a"}},
            apiKeySecret={"name": "keys"},
        )
        tls = PoolTLS("llama-sidecar-tls", "abc")
        template = pod_template(
            pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET, deployment, tls
        )
        spec = template["spec"]
        assert [v["name"] for v in spec["volumes"]] == [
            "config", "sidecar-token", "weights", "dshm", "api-key", "sidecar-tls",
            "sidecar-socket", "tmp", "cache",
        ]  # fmt: skip
        engine, sidecar = spec["containers"]
        assert [m["mountPath"] for m in engine["volumeMounts"]] == [
            "/etc/kvbank/config", "/var/run/kvbank/sidecar-token", "/var/run/kvbank/sidecar",
            "/var/cache/kvbank", "/models/llama-3.1-8b-instruct", "/dev/shm",
            "/etc/kvbank/api-key", "/etc/kvbank/sidecar-tls", "/tmp",
        ]  # fmt: skip
        assert [m["mountPath"] for m in sidecar["volumeMounts"]] == [
            "/etc/kvbank/config", "/var/run/kvbank/sidecar-token", "/var/run/kvbank/sidecar",
            "/etc/kvbank/sidecar-tls", "/tmp",
        ]  # fmt: skip
        assert template["metadata"]["annotations"]["kvbank.dev/sidecar-tls-serial"] == "abc"
        assert spec["nodeSelector"] == {"gpu": "a"}

    def test_a_tls_sidecar_is_probed_as_a_socket_a_plaintext_one_over_grpc(self) -> None:
        # The kubelet's gRPC probe cannot speak TLS: probing a TLS sidecar with it never
        # passes, and the pod never becomes Ready.
        pool, deployment = parse_modelpool(pool_doc()), _deployment()
        for tls, probe in (
            (PoolTLS("llama-sidecar-tls", "abc"), {"tcpSocket": {"port": "grpc"}}),
            (None, {"grpc": {"port": SETTINGS.sidecar_port}}),
        ):
            template = pod_template(
                pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET, deployment, tls
            )
            sidecar = template["spec"]["containers"][1]
            assert {k: v for k, v in sidecar["readinessProbe"].items() if k in probe} == probe

    def test_a_vllm_group_is_one_pod_with_all_its_gpus(self) -> None:
        pool = parse_modelpool(pool_doc(tensorParallel=4, replicas=3))
        deployment = _deployment(
            engine={"kind": "vllm"}, template={"resources": {"gpusPerRank": 1}}
        )
        sts = stateful_set(pool, OWNER, SETTINGS, "h", TOKEN_SECRET, deployment)
        assert sts["spec"]["replicas"] == 3
        engine = sts["spec"]["template"]["spec"]["containers"][0]
        assert engine["resources"] == {"limits": {"nvidia.com/gpu": 4}}
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["KVBANK_WORLD_SIZE"] == "1"
        # The same pool under kvbank's engine: one pod per rank.
        kvbank = stateful_set(pool, OWNER, SETTINGS, "h", TOKEN_SECRET, Deployment())
        assert kvbank["spec"]["replicas"] == 12


def _listens(sidecar: dict[str, Any]) -> list[str]:
    args = sidecar["args"]
    return [args[at + 1] for at, arg in enumerate(args) if arg == "--listen"]


class TestSidecarSocket:
    """The engine calls its sidecar on a Unix socket in an emptyDir both containers mount (the
    root filesystem is read-only); the pod address stays for the operator and the probes."""

    @staticmethod
    def _spec(deployment: Deployment, tls: PoolTLS | None = None) -> dict[str, Any]:
        pool = parse_modelpool(pool_doc(tensorParallel=2))
        template = pod_template(
            pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET, deployment, tls
        )
        return template["spec"]

    @pytest.mark.parametrize("tls", [None, PoolTLS("llama-sidecar-tls", "abc")])
    def test_the_engine_calls_the_socket_its_sidecar_listens_on_in_a_volume_both_mount(
        self, tls: PoolTLS | None
    ) -> None:
        spec = self._spec(Deployment(), tls)
        engine, sidecar = spec["containers"]
        called = engine["args"][engine["args"].index("--sidecar") + 1]
        assert called.startswith("unix:///")
        assert _listens(sidecar) == [f"0.0.0.0:{SETTINGS.sidecar_port}", called]
        path = PurePosixPath(called.removeprefix("unix://"))
        assert len(str(path)) <= UNIX_PATH_MAX
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in (engine, sidecar):
            [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
            assert mount == {"name": SOCKET_VOLUME, "mountPath": str(path.parent)}  # writable
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["KVBANK_SIDECAR_ADDR"] == called
        assert volumes[SOCKET_VOLUME] == {"name": SOCKET_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}}

    def test_vllm_calls_its_sidecar_on_the_same_socket(self) -> None:
        spec = self._spec(_deployment(engine={"kind": "vllm"}))
        engine, sidecar = spec["containers"]
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["KVBANK_SIDECAR"] == env["KVBANK_SIDECAR_ADDR"] == _listens(sidecar)[1]
        assert from_env({"KVBANK_SIDECAR": env["KVBANK_SIDECAR"]}).sidecar  # the plug-in takes it
        assert _listens(sidecar)[0] == "0.0.0.0:50051"
        assert {m["name"] for m in engine["volumeMounts"]} >= {SOCKET_VOLUME}

    def test_every_rank_of_a_group_gets_the_socket_and_reaches_rank_0_over_the_pod_network(
        self,
    ) -> None:
        """One template for every rank: a follower's engine ignores --sidecar (it takes rank 0's
        decisions over torch.distributed), and rank 0's sidecar stays on its pod address."""
        engine, sidecar = self._spec(Deployment())["containers"]
        for container in (engine, sidecar):
            script = container["command"][2]
            assert 'KVBANK_RANK0_SIDECAR="${KVBANK_RANK0_ADDR}:${KVBANK_SIDECAR_PORT}"' in script
        assert _listens(sidecar)[0] == "0.0.0.0:50051"
