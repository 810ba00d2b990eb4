"""The pure builders, one class each: inputs in, exact manifests out."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_specs import pool_doc

from kvbank.capacity import holdability, pool_pages
from kvbank.deployment import parse_deployment
from kvbank.modelpool import parse_modelpool
from kvbank.operator.pruning import stale_config_maps
from kvbank.operator.render.bundle import Rendered, render_pool
from kvbank.operator.render.engine_config import (
    config_data,
    config_hash,
    config_map,
    engine_config,
    pool_manifest,
)
from kvbank.operator.render.engines import SIDECAR_SOCKET, SOCKET_VOLUME
from kvbank.operator.render.names import (
    ANNOTATION_CONFIG_HASH,
    LWS_WORKER_INDEX,
    STS_POD_INDEX,
    Owner,
    RenderSettings,
    Workload,
)
from kvbank.operator.render.pods import pod_template, rank_env
from kvbank.operator.render.security import CACHE_VOLUME, SCRATCH_VOLUME, cache_env
from kvbank.operator.render.services import (
    disruption_budget,
    headless_service,
    traffic_service,
)
from kvbank.operator.render.status import Condition, conditions
from kvbank.operator.render.token import MissingSidecarToken, token_fingerprint, token_secret
from kvbank.operator.render.workloads import leader_worker_set, stateful_set, workload_refusal

OWNER = Owner("llama", "team-a", "uid-7")
SETTINGS = RenderSettings(image="registry.example/kvbank:1.2.3", sidecar_token="t0ken-for-tests")
TOKEN_SECRET = "llama-sidecar-token-0123456789"
SELECTOR = {"app.kubernetes.io/name": "kvbank", "kvbank.dev/pool": "llama"}


def _pool(**spec):
    return parse_modelpool(pool_doc(**spec))


def _owner_ref(manifest):
    return manifest["metadata"]["ownerReferences"]


class TestOwner:
    def test_reference_makes_the_model_pool_the_controller(self) -> None:
        assert OWNER.reference() == {
            "apiVersion": "kvbank.dev/v1alpha1",
            "kind": "ModelPool",
            "name": "llama",
            "uid": "uid-7",
            "controller": True,
            "blockOwnerDeletion": True,
        }


class TestEngineConfig:
    def test_carries_the_derived_figures(self) -> None:
        pool = _pool()
        config = engine_config(pool, holdability(pool))
        assert config == {
            "pool": "team-a/llama",
            "model": "llama-3.1-8b-instruct",
            "tensorParallel": 1,
            "pageSize": 16,
            "poolPages": 20000,
            "speculativeTokens": 1,
            "kvSlots": {"main": {"prompt": 1, "output": 1, "fixed": 0}},
            "limits": {"maxSeqLen": 8192, "maxTokens": 2048},
            "admission": {"policy": "peak", "backfill": True, "minConcurrency": 0},
            # ceil((8192 + 1) / 16) = 513 pages; (20000 - 1 sink) // 513 = 38
            "worstRequestPages": 513,
            "worstConcurrency": 38,
        }

    def test_pool_manifest_parses_back_to_the_same_pool(self) -> None:
        doc = pool_doc()
        manifest = pool_manifest(OWNER, doc["spec"])
        assert parse_modelpool(manifest) == parse_modelpool(doc)


class TestConfigMap:
    def test_data_is_yaml_the_sidecar_can_parse_and_hash_is_stable(self) -> None:
        pool = _pool()
        doc = pool_doc()
        data = config_data(pool, holdability(pool), OWNER, doc["spec"])
        assert sorted(data) == ["engine.json", "modelpool.yaml"]
        assert parse_modelpool(yaml.safe_load(data["modelpool.yaml"])) == pool
        assert json.loads(data["engine.json"])["poolPages"] == 20000
        again = config_data(pool, holdability(pool), OWNER, doc["spec"])
        assert config_hash(again) == config_hash(data)
        assert len(config_hash(data)) == 16

    def test_a_spec_change_changes_the_hash(self) -> None:
        doc = pool_doc()
        bigger = pool_doc(kv={"pageSize": 16, "pages": 30000, "speculativeTokens": 1})
        hashes = {
            config_hash(
                config_data(parse_modelpool(d), holdability(parse_modelpool(d)), OWNER, d["spec"])
            )
            for d in (doc, bigger)
        }
        assert len(hashes) == 2

    def test_manifest_is_immutable_and_named_by_its_hash(self) -> None:
        manifest = config_map(OWNER, {"a": "b"})
        digest = config_hash({"a": "b"})
        assert manifest["apiVersion"] == "v1" and manifest["kind"] == "ConfigMap"
        assert manifest["metadata"]["name"] == f"llama-engine-{digest[:10]}"
        assert manifest["metadata"]["labels"]["kvbank.dev/config-hash"] == digest
        assert manifest["metadata"]["labels"]["app.kubernetes.io/component"] == "config"
        assert manifest["metadata"]["namespace"] == "team-a"
        assert manifest["immutable"] is True
        assert _owner_ref(manifest) == [OWNER.reference()]
        assert manifest["data"] == {"a": "b"}


class TestPruning:
    def test_only_unmounted_old_configs_are_stale(self) -> None:
        config_maps = [
            {"metadata": {"name": n}} for n in ("p-engine-a", "p-engine-b", "p-engine-c")
        ]
        pods = [{"spec": {"volumes": [{"name": "config", "configMap": {"name": "p-engine-b"}}]}}]
        assert stale_config_maps(config_maps, pods, "p-engine-c") == ["p-engine-a"]
        assert stale_config_maps(config_maps, [], "p-engine-c") == ["p-engine-a", "p-engine-b"]


class TestHeadlessService:
    def test_publishes_every_rank_before_it_is_ready(self) -> None:
        svc = headless_service(OWNER, SETTINGS)
        assert svc["metadata"]["name"] == "llama-ranks"
        assert svc["spec"] == {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": SELECTOR,
            "ports": [{"name": "grpc", "port": 50051, "targetPort": "grpc"}],
        }
        assert _owner_ref(svc) == [OWNER.reference()]


class TestTrafficService:
    def test_one_pod_per_group_every_pod_of_a_stateful_set_is_a_rank_zero(self) -> None:
        svc = traffic_service(OWNER, SETTINGS, Workload.STATEFUL_SET, 1)
        assert svc["metadata"]["name"] == "llama"
        assert svc["spec"]["selector"] == SELECTOR
        assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]

    def test_several_pods_the_stateful_set_controllers_own_ordinal_label(self) -> None:
        svc = traffic_service(OWNER, SETTINGS, Workload.STATEFUL_SET, 2)
        assert svc["spec"]["selector"] == {**SELECTOR, STS_POD_INDEX: "0"}
        assert STS_POD_INDEX == "apps.kubernetes.io/pod-index"

    def test_selects_the_leader_of_a_leader_worker_set(self) -> None:
        for pods in (1, 4):
            svc = traffic_service(OWNER, SETTINGS, Workload.LEADER_WORKER_SET, pods)
            assert svc["spec"]["selector"] == {**SELECTOR, LWS_WORKER_INDEX: "0"}


class TestWorkloadRefusal:
    def test_only_several_groups_of_several_pods_in_one_stateful_set(self) -> None:
        def refusal(kind: Workload, engine: str = "kvbank", **spec: Any) -> str | None:
            doc = pool_doc(engine={"kind": engine}, **spec)
            return workload_refusal(parse_modelpool(doc), parse_deployment(doc), kind)

        sts, lws = Workload.STATEFUL_SET, Workload.LEADER_WORKER_SET
        assert refusal(sts, replicas=3, tensorParallel=1) is None
        assert refusal(sts, replicas=1, tensorParallel=2) is None
        assert refusal(sts, "vllm", replicas=3, tensorParallel=2) is None
        assert refusal(lws, replicas=3, tensorParallel=2) is None
        why = refusal(sts, replicas=3, tensorParallel=2)
        assert why is not None
        assert why.startswith(
            "spec.replicas=3 with spec.tensorParallel=2 runs 3 groups of 2 pods, which needs a "
            "LeaderWorkerSet"
        )
        assert "lower spec.replicas to 1" in why


class TestDisruptionBudget:
    def test_one_pod_at_a_time(self) -> None:
        pdb = disruption_budget(OWNER)
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}}
        assert _owner_ref(pdb) == [OWNER.reference()]


class TestPodTemplate:
    def test_engine_and_sidecar_share_the_rank_environment(self) -> None:
        pool = _pool(tensorParallel=2)
        template = pod_template(pool, SETTINGS, Workload.STATEFUL_SET, "abc123", TOKEN_SECRET)
        assert template["metadata"]["annotations"] == {ANNOTATION_CONFIG_HASH: "abc123"}
        engine, sidecar = template["spec"]["containers"]
        assert engine["name"] == "engine" and sidecar["name"] == "sidecar"
        assert engine["image"] == sidecar["image"] == "registry.example/kvbank:1.2.3"
        # The engine's alone: its HOME and caches on the writable cache volume.
        assert engine["env"] == sidecar["env"] + cache_env()
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["KVBANK_WORLD_SIZE"] == "2"
        assert env["KVBANK_DIST_PORT"] == "29500"
        assert engine["ports"] == [
            {"name": "http", "containerPort": 8000, "protocol": "TCP"},
            {"name": "dist", "containerPort": 29500, "protocol": "TCP"},
        ]
        assert env["KVBANK_SIDECAR_ADDR"] == "unix:///var/run/kvbank/sidecar/admission.sock"
        assert env["KVBANK_HEADLESS"] == "llama-ranks"
        assert engine["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert sidecar["resources"] == {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        }
        assert engine["args"] == [
            "kvbank", "serve", "--host", "0.0.0.0", "--port", "8000",
            "--sidecar", "unix:///var/run/kvbank/sidecar/admission.sock",
            "--sidecar-token-file", "/var/run/kvbank/sidecar-token/token",
            "--model", "/models/llama-3.1-8b-instruct",
            "--pages", "20000", "--page-size", "16", "--max-seq-len", "8192",
            "--max-tokens", "2048", "--policy", "peak+backfill",
        ]  # fmt: skip
        assert sidecar["args"] == [
            "kvbank", "sidecar", "--listen", "0.0.0.0:50051",
            "--listen", "unix:///var/run/kvbank/sidecar/admission.sock",
            "--token-file", "/var/run/kvbank/sidecar-token/token", "--metrics-port", "9464",
            "--metrics-host", "0.0.0.0", "--pool", "/etc/kvbank/config/modelpool.yaml",
            "--trusted-network",
        ]  # fmt: skip
        assert template["spec"]["volumes"] == [
            {"name": "config", "configMap": {"name": "llama-engine-abc123"}},
            {
                "name": "sidecar-token",
                "secret": {
                    "secretName": TOKEN_SECRET,
                    "items": [{"key": "token", "path": "token"}],
                },
            },
            {"name": "sidecar-socket", "emptyDir": {"sizeLimit": "1Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "cache", "emptyDir": {"sizeLimit": "16Gi"}},
        ]
        shared = [
            {"name": "config", "mountPath": "/etc/kvbank/config", "readOnly": True},
            {
                "name": "sidecar-token",
                "mountPath": "/var/run/kvbank/sidecar-token",
                "readOnly": True,
            },
            {"name": "sidecar-socket", "mountPath": "/var/run/kvbank/sidecar"},
        ]
        tmp = {"name": "tmp", "mountPath": "/tmp"}
        assert engine["volumeMounts"] == [
            *shared,
            {"name": "cache", "mountPath": "/var/cache/kvbank"},
            tmp,
        ]
        assert sidecar["volumeMounts"] == [*shared, tmp]
        assert template["spec"]["terminationGracePeriodSeconds"] == 600

    def test_the_commands_parse_with_the_real_subcommands(self) -> None:
        """The flags rendered are flags `kvbank serve` and `kvbank sidecar` accept."""
        from kvbank import cli

        pool = _pool(
            admission={"policy": "peak", "backfill": False},
            kv={"pageSize": 16, "memoryFraction": 0.5},
        )
        engine, sidecar = pod_template(pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET)[
            "spec"
        ]["containers"]
        for container in (engine, sidecar):
            argv = container["args"][1:]
            args = cli.build_parser(argv).parse_args(argv)
            assert args.command == argv[0]
        serve = cli.build_parser(engine["args"][1:]).parse_args(engine["args"][1:])
        assert serve.pages == pool_pages(pool) and serve.policy == "peak"

    def test_the_spec_policy_and_backfill_choose_the_engine_policy(self) -> None:
        """Every policy keeps its ledger in the sidecar, which reads the same spec.admission
        from --pool and so runs the same ledger."""
        from kvbank import cli
        from kvbank.engine.serve.flags import options_from_args

        expected = {
            ("conservative", False): "banker",
            ("conservative", True): "banker+backfill",
            ("peak", False): "peak",
            ("peak", True): "peak+backfill",
        }
        for (policy, backfill), engine_policy in expected.items():
            pool = _pool(admission={"policy": policy, "backfill": backfill})
            engine = pod_template(pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET)["spec"][
                "containers"
            ][0]
            args = engine["args"]
            assert args[args.index("--policy") + 1] == engine_policy
            assert args[args.index("--sidecar") + 1] == SIDECAR_SOCKET
            argv = args[1:]
            serve = cli.build_parser(argv).parse_args(argv)
            assert options_from_args(serve).policy == engine_policy  # serve accepts the pair

    def test_leader_worker_set_ranks_come_from_its_labels(self) -> None:
        env = rank_env(_pool(tensorParallel=2), SETTINGS, Workload.LEADER_WORKER_SET)
        by_name = {e["name"]: e for e in env}
        assert by_name["KVBANK_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
        )
        assert "KVBANK_RANK" not in {
            e["name"] for e in rank_env(_pool(), SETTINGS, Workload.STATEFUL_SET)
        }

    def test_stateful_set_prelude_computes_group_rank_and_leader(self) -> None:
        import subprocess

        command = pod_template(
            _pool(tensorParallel=4), SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET
        )["spec"]["containers"][0]["command"]
        env = {
            "POD_NAME": "llama-6",
            "POD_NAMESPACE": "team-a",
            "KVBANK_WORLD_SIZE": "4",
            "KVBANK_WORKLOAD": "llama",
            "KVBANK_HEADLESS": "llama-ranks",
            "KVBANK_SIDECAR_PORT": "50051",
            "PATH": "/usr/bin:/bin",
        }
        probe = [*command, "sh", "-c", "echo $KVBANK_GROUP $KVBANK_RANK $KVBANK_RANK0_SIDECAR"]
        out = subprocess.run(probe, env=env, capture_output=True, text=True, check=True)
        # ordinal 6 with TP 4: group 1, rank 2; group 1's rank 0 is ordinal 4
        assert out.stdout.split() == ["1", "2", "llama-4.llama-ranks.team-a.svc:50051"]

    def test_the_engine_reads_its_rank_from_what_the_stateful_set_renders(self) -> None:
        """The prelude's exports plus the rendered values are all `kvbank serve` needs to run
        one rank of its group: the rank, the group's size and rank 0's store."""
        import subprocess

        from kvbank.engine.tp.pod import PodRank, pod_rank

        pool = _pool(tensorParallel=4)
        engine = pod_template(pool, SETTINGS, Workload.STATEFUL_SET, "h", TOKEN_SECRET)["spec"][
            "containers"
        ][0]
        rendered = {e["name"]: e["value"] for e in engine["env"] if "value" in e}
        downward = {"POD_NAME": "llama-6", "POD_NAMESPACE": "team-a", "PATH": "/usr/bin:/bin"}
        out = subprocess.run([*engine["command"], "env"], env={**rendered, **downward},
                             capture_output=True, text=True, check=True)  # fmt: skip
        environ = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        assert pod_rank(None, None, None, environ) == PodRank(
            2, 4, "llama-4.llama-ranks.team-a.svc:29500"
        )

    def test_a_leader_worker_set_renders_the_same_contract(self) -> None:
        import subprocess

        from kvbank.engine.tp.pod import PodRank, pod_rank

        engine = pod_template(
            _pool(tensorParallel=2), SETTINGS, Workload.LEADER_WORKER_SET, "h", TOKEN_SECRET
        )["spec"]["containers"][0]
        rendered = {e["name"]: e["value"] for e in engine["env"] if "value" in e}
        # What the downward API reads from the LeaderWorkerSet's labels, and its leader address.
        lws = {"KVBANK_RANK": "1", "KVBANK_GROUP": "0", "POD_NAMESPACE": "team-a",
               "LWS_LEADER_ADDRESS": "llama-0.llama.team-a", "PATH": "/usr/bin:/bin"}  # fmt: skip
        out = subprocess.run([*engine["command"], "env"], env={**rendered, **lws},
                             capture_output=True, text=True, check=True)  # fmt: skip
        environ = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        assert pod_rank(None, None, None, environ) == PodRank(1, 2, "llama-0.llama.team-a:29500")


class TestStatefulSet:
    def test_replicas_times_tp_pods_in_parallel(self) -> None:
        sts = stateful_set(_pool(replicas=3, tensorParallel=2), OWNER, SETTINGS, "h", TOKEN_SECRET)
        assert sts["apiVersion"] == "apps/v1"
        assert sts["spec"]["replicas"] == 6
        assert sts["spec"]["serviceName"] == "llama-ranks"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["selector"] == {"matchLabels": SELECTOR}
        template_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert SELECTOR.items() <= template_labels.items()
        assert _owner_ref(sts) == [OWNER.reference()]


class TestLeaderWorkerSet:
    def test_one_group_of_tp_pods_per_replica(self) -> None:
        lws = leader_worker_set(
            _pool(replicas=3, tensorParallel=2), OWNER, SETTINGS, "h", TOKEN_SECRET
        )
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert lws["spec"]["replicas"] == 3
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert _owner_ref(lws) == [OWNER.reference()]


class TestTokenSecret:
    def test_immutable_owned_and_named_by_the_tokens_fingerprint(self) -> None:
        secret = token_secret(OWNER, "t0ken-for-tests")
        fingerprint = token_fingerprint("t0ken-for-tests", "uid-7")
        assert len(fingerprint) == 10 and fingerprint not in "t0ken-for-tests"
        assert secret == {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": f"llama-sidecar-token-{fingerprint}",
                "namespace": "team-a",
                "labels": {**SELECTOR, "app.kubernetes.io/instance": "llama",
                           "app.kubernetes.io/component": "sidecar-token",
                           "app.kubernetes.io/managed-by": "kvbank-operator"},
                "ownerReferences": [OWNER.reference()],
            },
            "type": "Opaque",
            "immutable": True,
            "data": {"token": base64.b64encode(b"t0ken-for-tests").decode()},
        }  # fmt: skip

    def test_the_fingerprint_depends_on_the_token_and_the_pools_uid(self) -> None:
        prints = {
            token_fingerprint(token, uid) for token in ("a", "b") for uid in ("uid-1", "uid-2")
        }
        assert len(prints) == 4
        assert token_fingerprint("a", "uid-1") == token_fingerprint("a", "uid-1")

    def test_no_token_says_how_to_set_one(self) -> None:
        for token in (None, ""):
            with pytest.raises(MissingSidecarToken) as caught:
                token_secret(OWNER, token)
            assert "set KVBANK_SIDECAR_TOKEN or --sidecar-token on the operator" in str(
                caught.value
            )


class TestPodsStartWithoutAKubelet:
    """What the kubelet would do with a rendered pod, short of running it: project the ConfigMap
    and Secret into files, then hand each container's args to its own command's parser and
    config check. `kvbank sidecar` on the pod address refuses to start without a token, which
    no apiserver-only test sees."""

    @staticmethod
    def _template(rendered: Rendered) -> dict:
        spec = rendered.manifests[-1]["spec"]
        if rendered.workload is Workload.LEADER_WORKER_SET:
            return spec["leaderWorkerTemplate"]["workerTemplate"]
        return spec["template"]

    def _mount(self, rendered: Rendered, root: Path) -> dict[str, Path]:
        """Each volume's files under `root`, as the kubelet projects them; mountPath -> folder."""
        config_map = rendered.manifests[0]
        secret = rendered.token_secret
        template = self._template(rendered)
        folders = {}
        for volume in template["spec"]["volumes"]:
            folder = root / volume["name"]
            folder.mkdir()
            if volume["name"] == SOCKET_VOLUME:
                folders[volume["name"]] = folder  # the sidecar binds its socket in it
                continue
            if "emptyDir" in volume:
                continue  # the scratch folders: written by the containers, read by none here
            if "configMap" in volume:
                assert volume["configMap"]["name"] == config_map["metadata"]["name"]
                for key, text in config_map["data"].items():
                    (folder / key).write_text(text)
            else:
                assert volume["secret"]["secretName"] == secret["metadata"]["name"]
                for item in volume["secret"]["items"]:
                    (folder / item["path"]).write_bytes(
                        base64.b64decode(secret["data"][item["key"]])
                    )
            folders[volume["name"]] = folder
        mounts: dict[str, Path] = {}
        for container in template["spec"]["containers"]:
            for mount in container["volumeMounts"]:
                if mount["name"] in (SCRATCH_VOLUME, CACHE_VOLUME):
                    continue
                if mount["name"] == SOCKET_VOLUME:
                    assert "readOnly" not in mount  # the sidecar binds its socket in it
                else:
                    assert mount["readOnly"] is True
                mounts[mount["mountPath"]] = folders[mount["name"]]
        return mounts

    @staticmethod
    def _local(args: list[str], mounts: dict[str, Path]) -> list[str]:
        out = []
        for arg in args:
            scheme = "unix://" if arg.startswith("unix:///") else ""
            for mount_path, folder in mounts.items():
                if arg.startswith(scheme + mount_path + "/"):
                    arg = scheme + str(folder) + arg[len(scheme + mount_path) :]
            out.append(arg)
        return out

    def _containers(self, tmp_path: Path, workload: Workload) -> tuple[list[str], list[str]]:
        pool, doc = _pool(tensorParallel=2), pool_doc(tensorParallel=2)
        rendered = render_pool(pool, holdability(pool), OWNER, doc["spec"], SETTINGS, workload)
        mounts = self._mount(rendered, tmp_path)
        engine, sidecar = self._template(rendered)["spec"]["containers"]
        return self._local(engine["args"], mounts), self._local(sidecar["args"], mounts)

    @pytest.mark.parametrize("workload", list(Workload))
    def test_the_sidecar_accepts_its_args_and_holds_the_operators_token(
        self, tmp_path: Path, workload: Workload
    ) -> None:
        from kvbank import cli
        from kvbank.sidecar.server import config_from_args

        _, sidecar = self._containers(tmp_path, workload)
        argv = sidecar[1:]
        config = config_from_args(cli.build_parser(argv).parse_args(argv))
        assert config.listen == (
            "0.0.0.0:50051",
            f"unix://{tmp_path}/sidecar-socket/admission.sock",
        )
        # The token the operator's status reads send (SidecarClientSource) is the one it checks.
        assert config.token == SETTINGS.sidecar_token
        assert (
            config.pool_pages == 20000 and config.policy == "peak+backfill"
        )  # the default spec.admission

    def test_the_engine_reads_the_same_token(self, tmp_path: Path) -> None:
        from kvbank import cli
        from kvbank.engine.serve.flags import options_from_args

        engine, _ = self._containers(tmp_path, Workload.STATEFUL_SET)
        argv = engine[1:]
        options = options_from_args(cli.build_parser(argv).parse_args(argv))
        assert options.sidecar == f"unix://{tmp_path}/sidecar-socket/admission.sock"
        assert options.sidecar_token_file is not None
        # As kvbank.engine.serve.stack reads it.
        assert Path(options.sidecar_token_file).read_text().strip() == SETTINGS.sidecar_token

    def test_the_check_catches_a_sidecar_rendered_without_its_token(self, tmp_path: Path) -> None:
        """The regression this class guards against: without --token-file the sidecar exits."""
        from kvbank import cli
        from kvbank.sidecar.server import ConfigError, config_from_args

        _, sidecar = self._containers(tmp_path, Workload.STATEFUL_SET)
        at = sidecar.index("--token-file")
        argv = sidecar[1:at] + sidecar[at + 2 :]
        with pytest.raises(ConfigError, match="not a loopback address: give --token-file"):
            config_from_args(cli.build_parser(argv).parse_args(argv))


class TestRenderPool:
    def test_config_first_then_services_budget_and_workload(self) -> None:
        pool, doc = _pool(), pool_doc()
        rendered = render_pool(
            pool, holdability(pool), OWNER, doc["spec"], SETTINGS, Workload.STATEFUL_SET
        )
        assert rendered.token_secret["kind"] == "Secret"  # created before the rest is applied
        kinds = [(m["kind"], m["metadata"]["name"]) for m in rendered.manifests]
        assert kinds == [
            ("ConfigMap", f"llama-engine-{rendered.config_hash[:10]}"),
            ("Service", "llama-ranks"),
            ("Service", "llama"),
            ("PodDisruptionBudget", "llama"),
            ("StatefulSet", "llama"),
        ]
        template = rendered.manifests[-1]["spec"]["template"]
        assert template["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] == rendered.config_hash
        config, token, socket, scratch, cache = template["spec"]["volumes"]
        assert (socket["name"], scratch["name"], cache["name"]) == (
            SOCKET_VOLUME,
            SCRATCH_VOLUME,
            CACHE_VOLUME,
        )
        assert config["configMap"]["name"] == rendered.manifests[0]["metadata"]["name"]
        assert token["secret"]["secretName"] == rendered.token_secret["metadata"]["name"]

    def test_the_token_changes_the_secret_and_pods_but_not_the_config(self) -> None:
        pool, doc = _pool(), pool_doc()
        args = (pool, holdability(pool), OWNER, doc["spec"])
        first = render_pool(*args, SETTINGS, Workload.STATEFUL_SET)
        other = dataclasses.replace(SETTINGS, sidecar_token="another-token")
        second = render_pool(*args, other, Workload.STATEFUL_SET)
        assert first.config_hash == second.config_hash
        assert first.manifests[0] == second.manifests[0]  # the ConfigMap
        assert first.token_secret["metadata"]["name"] != second.token_secret["metadata"]["name"]
        assert first.manifests[-1] != second.manifests[-1]  # the pod template: a roll
        for manifest in first.manifests:
            assert "t0ken-for-tests" not in json.dumps(manifest), manifest["kind"]

    def test_without_a_token_nothing_renders(self) -> None:
        pool, doc = _pool(), pool_doc()
        with pytest.raises(MissingSidecarToken, match="set KVBANK_SIDECAR_TOKEN or --sidecar"):
            render_pool(
                pool, holdability(pool), OWNER, doc["spec"], RenderSettings(), Workload.STATEFUL_SET
            )

    def test_same_inputs_render_identical_manifests(self) -> None:
        pool, doc = _pool(), pool_doc()
        args = (pool, holdability(pool), OWNER, doc["spec"], SETTINGS, Workload.LEADER_WORKER_SET)
        assert render_pool(*args) == render_pool(*args)


class TestConditions:
    def test_transition_time_moves_only_when_status_changes(self) -> None:
        first = conditions(None, [Condition("Accepted", True, "Holdable", "ok")], 1, "t1")
        assert first == [
            {
                "type": "Accepted",
                "status": "True",
                "reason": "Holdable",
                "message": "ok",
                "observedGeneration": 1,
                "lastTransitionTime": "t1",
            }
        ]
        same = conditions(first, [Condition("Accepted", True, "Holdable", "still")], 2, "t2")
        assert same[0]["lastTransitionTime"] == "t1" and same[0]["observedGeneration"] == 2
        flipped = conditions(same, [Condition("Accepted", False, "Unholdable", "no")], 3, "t3")
        assert flipped[0]["lastTransitionTime"] == "t3" and flipped[0]["status"] == "False"

    def test_other_conditions_are_kept_in_a_stable_order(self) -> None:
        start = conditions(None, [Condition("Ready", False, "GroupsNotReady")], 1, "t1")
        both = conditions(start, [Condition("Accepted", True, "Holdable")], 1, "t2")
        assert [c["type"] for c in both] == ["Accepted", "Ready"]
