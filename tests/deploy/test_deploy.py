"""Deployment artifacts, checked offline with the real tools: every Dockerfile parsed, the
compose file through the Docker Compose v2 binary, the kustomize overlays rendered by kubectl
and validated strictly, the CRDs field-checked, and every TREADLE_* variable they set
cross-checked against the settings class."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import compose
import pytest
import yaml

from tests.support.services import ROOT
from treadle_cli.settings import CliSettings
from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.auth.infra import InfraSecrets
from treadle_common.config.settings import Settings
from treadle_env_gateway.settings import EnvGatewaySettings
from treadle_reward.settings import RewardSettings
from treadle_rollout.settings import RolloutSettings
from treadle_trainer.settings import TrainerSettings
from treadle_weight_store.settings import WeightStoreSettings

pytestmark = pytest.mark.unit

SERVICES = ["weight-store", "env-gateway", "reward", "rollout", "trainer"]
BIN = Path(sys.executable).parent
COMPOSE = Path(compose.__file__).parent / "docker-compose"
OVERLAYS = ["dev", "gpu", "gpu-megatron"]
SERVICE_SETTINGS: dict[str, type[Settings]] = {
    "weight-store": WeightStoreSettings,
    "env-gateway": EnvGatewaySettings,
    "reward": RewardSettings,
    "rollout": RolloutSettings,
    "trainer": TrainerSettings,
}


def variables(settings: type[Settings]) -> set[str]:
    return {f"TREADLE_{name.upper()}" for name in settings.model_fields}


SETTINGS_VARS = set().union(*map(variables, [*SERVICE_SETTINGS.values(), CliSettings]))


# --- Dockerfiles ---------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def installed(steps: list[tuple[str, str]]) -> list[str]:
    """What the `pip install` steps install (requirement arguments, options dropped)."""
    out = []
    for keyword, args in steps:
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            skip = False
            for word in words[2:]:
                if skip:
                    skip = False
                elif word in ("--index-url", "--extra-index-url", "-r"):
                    skip = True
                elif not word.startswith(("-", "$")):  # "${WHEELS_URL:+--find-links ...}"
                    out.append(word)
    return out


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_image_installs_only_its_distribution_and_common(service):
    for name in ("Dockerfile", "Dockerfile.gpu"):
        path = ROOT / "services" / service / name
        if name == "Dockerfile.gpu" and service not in ("rollout", "trainer"):
            assert not path.exists()
            continue
        steps = instructions(path)
        keywords = [k for k, _ in steps]
        packages = [p for p in installed(steps) if not p.startswith("torch==")]
        assert sorted(re.sub(r"\[.*\]$", "", p) for p in packages) == sorted(
            ["/src/libs/common", f"/src/services/{service}"]
        ), (path, packages)
        copied = [args.split()[0] for k, args in steps if k == "COPY" and "--from" not in args]
        lock = [f"requirements/images/{service}.txt"] if name == "Dockerfile" else []
        assert copied == [*lock, "libs/common", f"services/{service}"], (path, copied)
        users = [args for k, args in steps if k == "USER"]
        assert users and users[-1] not in ("root", "0"), path
        assert "HEALTHCHECK" in keywords and "CMD" in keywords, path
        health = next(args for k, args in steps if k == "HEALTHCHECK")
        assert "/healthz" in health, path
        module = "treadle_" + service.replace("-", "_")
        assert module in next(args for k, args in reversed(steps) if k == "CMD"), path
        if name == "Dockerfile":  # slim, multi-stage: the runtime stage copies the venv only
            froms = [args for k, args in steps if k == "FROM"]
            assert len(froms) == 2 and froms[0].endswith("AS build"), path
            assert any(k == "ARG" and "slim" in a for k, a in steps), path
            assert any(k == "COPY" and a.startswith("--from=build") for k, a in steps), path


DOCKERFILES = sorted(
    [
        *ROOT.glob("services/*/Dockerfile*"),
        ROOT / "libs/cli/Dockerfile",
        *ROOT.glob("deploy/*/Dockerfile*"),
    ]
)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfiles_take_their_package_sources_as_build_arguments(path):
    """Buildable behind a mirror: no `# syntax=` line (BuildKit would pull a frontend image),
    no index URL or host in a command, pip's sources from build arguments, and a CA bundle
    only as the `pip_ca` build secret, in the build stage."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M), path
    steps = instructions(path)
    runs = [args for k, args in steps if k == "RUN"]
    assert not any(re.search(r"https?://", run) for run in runs), path
    args = {a.split("=")[0] for k, a in steps if k == "ARG"}
    for run in runs:
        if "pip install" in run and "gpu" not in path.name:
            assert run.startswith("--mount=type=secret,id=pip_ca"), (path, run)
            assert "PIP_INDEX_URL" in args, path
        if "torch==" in run and "gpu" not in path.name:
            assert '--index-url "$TORCH_INDEX_URL"' in run and "TORCH_INDEX_URL" in args, path
    assert not any("pip_ca" in a for k, a in steps if k in ("COPY", "ADD", "ENV")), path


def test_the_cli_image_installs_the_cli_and_no_service():
    steps = instructions(ROOT / "libs" / "cli" / "Dockerfile")
    packages = [p for p in installed(steps) if not p.startswith("torch==")]
    assert packages == ["/src/libs/common[hf]", "/src/libs/cli[hf,report]"]
    # the build runs the installed `treadle` script: an image without one does not build
    assert any(k == "RUN" and "treadle --help" in a for k, a in steps)
    assert [a for k, a in steps if k == "ENTRYPOINT"] == ['["treadle"]']
    assert [a for k, a in steps if k == "USER"][-1] == "treadle"


# --- compose -------------------------------------------------------------------------------------
_TABLE = auth.TokenTable.generate()
COMPOSE_TOKENS = {
    **{f"TREADLE_TOKEN_{role.upper()}": token for role, token in _TABLE.items()},
    **{f"TREADLE_TOKEN_{role.upper()}_SHA256": auth.token_hash(t) for role, t in _TABLE.items()},
    **InfraSecrets.generate().env(),
    "TREADLE_S3_ACCESS_KEY": "test-access",
    "TREADLE_S3_SECRET_KEY": "test-secret",
}
"""What `treadle secrets >> .env` gives compose: a token per role, the infra passwords, S3
keys."""
SECRET_VARS = ("TREADLE_TOKEN", "REDIS_PASSWORD", "NATS_PASSWORD", "TREADLE_S3_")


REDIS_USERS = infra_auth.redis_server_args(
    lambda user: "#" + COMPOSE_TOKENS[infra_auth.redis_password_env(user) + "_SHA256"]
)
"""The redis-server words that define the service users, as compose renders them."""


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict:
    args = [str(COMPOSE), "-f", str(ROOT / "compose.yaml")]
    for profile in profiles:
        args += ["--profile", profile]
    env = {**os.environ, **COMPOSE_TOKENS} if env is None else env
    checked = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stderr
    rendered = subprocess.run(
        [*args, "config", "--format", "json"], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(rendered.stdout)


def test_compose_has_no_default_secrets_and_gives_each_service_its_role():
    bare = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_VARS)}
    for name in COMPOSE_TOKENS:  # each secret is required on its own: no defaults
        if name in ("TREADLE_TOKEN_AGENT", "TREADLE_TOKEN_TINKER"):
            continue  # a client's: no container presents it (servers hold its hash)
        refused = subprocess.run(
            [str(COMPOSE), "-f", str(ROOT / "compose.yaml"), "config", "-q"],
            capture_output=True,
            text=True,
            env={**bare, **{k: v for k, v in COMPOSE_TOKENS.items() if k != name}},
        )
        assert refused.returncode != 0 and "treadle secrets" in refused.stderr, name
    services = compose_config("cpu", "demo")["services"]
    # redis needs the admin's password and holds each service user's hash with its ACL;
    # nats runs the committed users file; each service its own user of both
    redis_password = COMPOSE_TOKENS[infra_auth.REDIS_PASSWORD_ENV]
    assert services["redis"]["command"][1:3] == ["--requirepass", redis_password]
    assert services["redis"]["command"][-len(REDIS_USERS) :] == REDIS_USERS
    assert not set(services["redis"]["command"]) & {
        COMPOSE_TOKENS[infra_auth.redis_password_env(u)] for u in infra_auth.REDIS_SERVICES
    }  # hashes only
    assert services["nats"]["command"][:2] == ["--config", "/etc/nats/nats.conf"]
    [conf] = [v for v in services["nats"]["volumes"] if v["target"] == "/etc/nats/nats.conf"]
    assert Path(conf["source"]) == ROOT / "deploy/nats/nats.conf" and conf["read_only"]
    for user in infra_auth.NATS_USERS:
        env = infra_auth.password_env(user)
        assert services["nats"]["environment"][env] == COMPOSE_TOKENS[env]
    for name in [*SERVICES, "demo"]:
        environment = services[name]["environment"]
        user = "admin" if name == "demo" else name
        password = COMPOSE_TOKENS[infra_auth.password_env(user)]
        assert environment["TREADLE_NATS_URL"] == f"nats://{user}:{password}@nats:4222", name
        if name in infra_auth.REDIS_SERVICES:
            password = COMPOSE_TOKENS[infra_auth.redis_password_env(name)]
            assert environment["TREADLE_REDIS_URL"] == f"redis://{name}:{password}@redis:6379"
        elif name == "demo":  # the operator's CLI: the admin
            assert environment["TREADLE_REDIS_URL"] == f"redis://:{redis_password}@redis:6379"
        else:  # a service that never uses Redis gets no credentials for it
            assert "TREADLE_REDIS_URL" not in environment, name
    table = auth.TokenTable.parse(services["reward"]["environment"]["TREADLE_AUTH_TOKENS"], "c")
    for name, svc in services.items():
        environment = svc.get("environment") or {}
        if "TREADLE_TOKEN" not in environment:
            assert name in ("redis", "nats", "minio", "model-init"), name
            continue
        role = auth.Role.admin if name == "demo" else auth.SERVICE_ROLES[name]
        assert table.role_of(environment["TREADLE_TOKEN"]) is role, name
        if name != "demo":  # a service holds hashes and its own token, no other token
            others = {t for r, t in _TABLE.items() if r != auth.SERVICE_ROLES[name].value}
            assert not others & {str(v) for v in environment.values()}, name
            assert not any(t in json.dumps(environment) for t in others), name
        if name != "demo":
            assert (
                environment["TREADLE_AUTH_TOKENS"]
                == services["reward"]["environment"]["TREADLE_AUTH_TOKENS"]
            )


def test_compose_validates_with_the_real_compose_binary():
    config = compose_config("cpu", "gpu", "demo")
    services = config["services"]
    assert set(SERVICES) | {"rollout-gpu", "trainer-gpu", "demo"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    assert "--jetstream" in services["nats"]["command"]
    assert services["minio"]["image"].startswith("minio/minio")
    for name, svc in services.items():
        if name in ("model-init", "demo"):
            continue
        dockerfile = svc.get("build", {}).get("dockerfile")
        from_image = dockerfile and "HEALTHCHECK" in dict(instructions(ROOT / dockerfile))
        # compose keeps the image's HEALTHCHECK test when it only sets the timings
        assert svc["healthcheck"].get("test") or from_image, f"{name} has no healthcheck"
        for dep, cond in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == "model-init" else "service_healthy"
            assert cond["condition"] == want, (name, dep)
    for name in ("rollout-gpu", "trainer-gpu"):
        assert services[name]["profiles"] == ["gpu"]
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert {"redis-data", "nats-data", "minio-data", "models", "trainer-state"} <= set(
        config["volumes"]
    )
    # the default profile (.env.example, copied to .env: COMPOSE_PROFILES=cpu) is the CPU stack
    default = subprocess.run(
        [str(COMPOSE), "--env-file", str(ROOT / ".env.example"), "config", "--services"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **COMPOSE_TOKENS},
    )
    assert set(default.stdout.split()) == {
        "redis", "nats", "minio", "model-init", *SERVICES,
    }  # fmt: skip


def test_compose_scales_without_shared_identities_or_docker_socket():
    """Replicas are distinct consumers (no fixed TREADLE_INSTANCE: each its hostname), a
    scaled service gets a host port per replica, env-gateway holds no Docker socket unless
    the opt-in override adds it, and `.env` (secrets) is not in git."""
    services = compose_config("cpu")["services"]
    for name in SERVICES:
        assert "TREADLE_INSTANCE" not in services[name].get("environment", {}), name
    gateway = services["env-gateway"]
    assert not any("docker.sock" in str(v) for v in gateway.get("volumes", [])), gateway
    assert "DOCKER_HOST" not in gateway["environment"]
    # its own seccomp profile (never Unconfined): the committed one, rendered from the
    # sandbox's deny list
    assert "seccomp=unconfined" not in gateway["security_opt"]
    assert {f"seccomp=./{PROFILE}", "systempaths=unconfined"} <= set(gateway["security_opt"])
    env = {**os.environ, **COMPOSE_TOKENS}
    files = ["-f", str(ROOT / "compose.yaml")]
    for extra, check in (
        ("scale.yaml", lambda svc: all(p.get("published", "") == "" for p in svc["ports"])),
        ("docker-sandbox.yaml", lambda svc: "docker.sock" in json.dumps(svc.get("volumes"))),
    ):
        args = [str(COMPOSE), *files, "-f", str(ROOT / "deploy" / "compose" / extra)]
        out = subprocess.run(
            [*args, "--profile", "cpu", "config", "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        rendered = json.loads(out.stdout)["services"]
        targets = ("rollout", "reward") if extra == "scale.yaml" else ("env-gateway",)
        assert all(check(rendered[t]) for t in targets), extra
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".env must be ignored by git"
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout.strip() == ""


def test_every_image_names_a_version_never_latest(rendered):
    """Kubernetes runs what was tested: every container image has an explicit tag (or a
    digest), and none is `latest`."""
    _, docs = rendered
    images = [
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")
        for c in d["spec"]["template"]["spec"].get("initContainers", [])
        + d["spec"]["template"]["spec"]["containers"]
    ]
    assert images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and tag and "/" not in tag), image
        assert not image.endswith(":latest"), image
    compose = (ROOT / "compose.yaml").read_text()
    assert ":latest" not in compose


def test_no_pod_mounts_a_service_account_token_and_reward_reaches_env_gateway(rendered):
    _, docs = rendered
    pods = [
        d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")
    ]
    assert pods and all(p.get("automountServiceAccountToken") is False for p in pods)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]

    def allows(policy_kind: str, selected: str, peer: str, port: int) -> bool:
        key = "ingress" if policy_kind == "Ingress" else "egress"
        side = "from" if key == "ingress" else "to"
        for p in policies:
            labels = p["spec"]["podSelector"].get("matchLabels", {})
            exprs = p["spec"]["podSelector"].get("matchExpressions", [])
            names = {labels.get("app.kubernetes.io/name")} | {
                v for e in exprs for v in e.get("values", [])
            }
            if selected not in names:
                continue
            for rule in p["spec"].get(key, []):
                peers = rule.get(side, [])
                peer_names = {
                    (q.get("podSelector") or {})
                    .get("matchLabels", {})
                    .get("app.kubernetes.io/name")
                    for q in peers
                }
                if peer in peer_names and any(x["port"] == port for x in rule.get("ports", [])):
                    return True
        return False

    assert allows("Egress", "reward", "env-gateway", 50052)
    assert allows("Ingress", "env-gateway", "reward", 50052)


# --- kubernetes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return render(request.param)


def render(overlay: str) -> tuple[str, list[dict]]:
    kubectl = BIN / "kubectl"
    assert kubectl.exists(), "make setup installs kubectl (scripts/install_kubectl.py)"
    out = subprocess.run(
        [str(kubectl), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, [d for d in yaml.safe_load_all(out.stdout) if d]


def secret_keys(node, secret: str) -> set[str]:
    """The keys of `secret` that anything in `node` (the rendered manifests) reads."""
    if isinstance(node, list):
        return set().union(*(secret_keys(n, secret) for n in node))
    if not isinstance(node, dict):
        return set()
    ref = node.get("secretKeyRef")
    found = {ref["key"]} if isinstance(ref, dict) and ref.get("name") == secret else set()
    return found.union(*(secret_keys(v, secret) for v in node.values()))


def kinds(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_overlays_pass_strict_schema_validation(rendered, tmp_path):
    text, docs = rendered
    custom = ("ScaledObject", "TriggerAuthentication", "PyTorchJob")
    builtin = [d for d in docs if d["kind"] not in custom]
    # the PyTorchJob's pod templates are built-in PodTemplates: validate them strictly too
    for job in kinds(docs, "PyTorchJob").values():
        for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
            builtin.append(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{job['metadata']['name']}-{role.lower()}"},
                    "template": spec["template"],
                }
            )
    path = tmp_path / "builtin.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Couldn't find schema" not in result.stdout + result.stderr


SCALED_OBJECT_SPEC = {
    "scaleTargetRef": {"name", "kind", "apiVersion", "envSourceContainerName"},
    "pollingInterval": None,
    "cooldownPeriod": None,
    "initialCooldownPeriod": None,
    "idleReplicaCount": None,
    "minReplicaCount": None,
    "maxReplicaCount": None,
    "fallback": {"failureThreshold", "replicas", "behavior"},
    "advanced": {
        "restoreToOriginalReplicaCount",
        "horizontalPodAutoscalerConfig",
        "scalingModifiers",
    },
    "triggers": {"type", "name", "metadata", "metricType", "useCachedMetrics", "authenticationRef"},
}
TRIGGER_METADATA = {  # what each KEDA scaler we use requires
    "metrics-api": {"url", "valueLocation", "targetValue"},
    "prometheus": {"serverAddress", "query", "threshold"},
    "cpu": {"value"},
}


def test_keda_scaled_objects_are_field_checked(rendered):
    _, docs = rendered
    scaled = kinds(docs, "ScaledObject")
    assert set(scaled) == {"rollout", "reward"}
    deployments = kinds(docs, "Deployment")
    for obj in scaled.values():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        assert set(spec) <= set(SCALED_OBJECT_SPEC), set(spec) - set(SCALED_OBJECT_SPEC)
        for key, allowed in SCALED_OBJECT_SPEC.items():
            if allowed is None:
                assert isinstance(spec.get(key, 0), int), key
            elif key == "triggers":
                for trigger in spec[key]:
                    assert set(trigger) <= allowed and {"type", "metadata"} <= set(trigger)
                    metadata = trigger["metadata"]
                    assert all(isinstance(v, str) for v in metadata.values()), metadata
                    assert TRIGGER_METADATA[trigger["type"]] <= set(metadata), trigger
            elif key in spec:
                assert set(spec[key]) <= allowed, (key, set(spec[key]) - allowed)
        assert spec["scaleTargetRef"]["name"] in deployments
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # KEDA takes over the reward HPA rather than fighting a second one
    reward = scaled["reward"]
    assert reward["metadata"]["annotations"]["scaledobject.keda.sh/transfer-hpa-ownership"]
    assert reward["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"] == "reward"
    assert "reward" in kinds(docs, "HorizontalPodAutoscaler")
    # rollout scales on the trainer's Redis backlog endpoint, which exists
    (metrics_api,) = scaled["rollout"]["spec"]["triggers"]
    # ... and calls it with the read role's token (auth is on for every route but probes)
    assert metrics_api["metadata"]["authMode"] == "bearer"
    trigger_auth = kinds(docs, "TriggerAuthentication")[metrics_api["authenticationRef"]["name"]]
    assert trigger_auth["spec"]["secretTargetRef"] == [
        {"parameter": "token", "name": "treadle-auth", "key": "read"}
    ]
    assert metrics_api["metadata"]["url"].endswith("/v1/backlog")


def test_trainer_is_a_pytorchjob_with_rank0_serving(rendered):
    _, docs = rendered
    job = kinds(docs, "PyTorchJob")["trainer"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert set(job["spec"]) <= {"runPolicy", "pytorchReplicaSpecs", "elasticPolicy", "nprocPerNode"}
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("None", "All", "Running")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for spec in replicas.values():
        assert set(spec) <= {"replicas", "restartPolicy", "template"}
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        assert spec["template"]["spec"]["containers"][0]["name"] == "pytorch"  # the operator's
    service = kinds(docs, "Service")["trainer"]
    assert service["spec"]["selector"]["training.kubeflow.org/replica-type"] == "master"


def test_probes_headless_sessions_pdbs_and_policies(rendered):
    text, docs = rendered
    deployments = kinds(docs, "Deployment")
    assert set(deployments) == {"weight-store", "env-gateway", "reward", "rollout"}
    for name, dep in deployments.items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
    services = kinds(docs, "Service")
    assert services["env-gateway"]["spec"]["clusterIP"] == "None"  # sessions stick to a pod
    assert set(kinds(docs, "HorizontalPodAutoscaler")) == {"reward", "env-gateway"}
    assert set(kinds(docs, "PodDisruptionBudget")) == {
        "env-gateway",
        "reward",
        "rollout",
        "trainer",
    }
    policies = kinds(docs, "NetworkPolicy")
    assert policies["default-deny"]["spec"]["podSelector"] == {}
    assert policies["default-deny"]["spec"]["policyTypes"] == ["Ingress", "Egress"]
    redis = policies["redis-from-rollout-and-trainer"]["spec"]["ingress"][0]["from"][0]
    assert redis["podSelector"]["matchExpressions"][0]["values"] == ["rollout", "trainer"]
    assert kinds(docs, "PersistentVolumeClaim")["weight-store"]


def order(container: dict) -> list[str]:
    return [e["name"] for e in container["env"]]


def test_every_service_pod_gets_the_token_table_and_its_role_token(rendered):
    text, docs = rendered
    pods = {
        name: dep["spec"]["template"]["spec"]["containers"][0]
        for name, dep in kinds(docs, "Deployment").items()
    }
    for job in kinds(docs, "PyTorchJob").values():
        for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
            pods[f"trainer/{role}"] = spec["template"]["spec"]["containers"][0]
    assert {name.split("/")[0] for name in pods} == set(SERVICES)
    for pod, container in pods.items():
        name = pod.split("/")[0]
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
        assert env["TREADLE_AUTH_TOKENS"] == {"name": "treadle-auth", "key": "tokens.json"}, name
        role = auth.SERVICE_ROLES[name].value
        assert env["TREADLE_TOKEN"] == {"name": "treadle-auth", "key": role}, name
        # Redis and NATS credentials: its own users, built into the URLs it reads; none of
        # Redis for a service that never uses it
        assert env["NATS_PASSWORD"] == {"name": "treadle-auth", "key": f"nats-password-{name}"}
        values = {e["name"]: e.get("value") for e in container["env"]}
        if name in infra_auth.REDIS_SERVICES:
            key = f"redis-password-{name}"
            assert env["REDIS_PASSWORD"] == {"name": "treadle-auth", "key": key}
            assert values["TREADLE_REDIS_URL"] == f"redis://{name}:$(REDIS_PASSWORD)@redis:6379"
            assert order(container).index("REDIS_PASSWORD") < order(container).index(
                "TREADLE_REDIS_URL"
            )
        else:
            assert "REDIS_PASSWORD" not in env and "TREADLE_REDIS_URL" not in values, name
        assert values["TREADLE_NATS_URL"] == f"nats://{name}:$(NATS_PASSWORD)@nats:4222"
        # k8s expands $(VAR) of earlier ones
        assert order(container).index("NATS_PASSWORD") < order(container).index("TREADLE_NATS_URL")
    # redis holds the admin's password and each service user's hash, with its ACL
    [redis_pod] = [
        d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if d.get("kind") in ("Deployment", "StatefulSet") and d["metadata"]["name"] == "redis"
    ]
    args = infra_auth.redis_server_args(
        lambda user: f"#$({infra_auth.redis_password_env(user)}_SHA256)"
    )
    assert redis_pod["args"][-len(args) :] == args
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in redis_pod["env"]}
    for user in infra_auth.REDIS_SERVICES:
        key = f"redis-password-{user}-sha256"
        assert env[infra_auth.redis_password_env(user) + "_SHA256"]["key"] == key
    # no Secret in the manifests: the operator generates `treadle-auth` (no default keys)
    assert kinds(docs, "Secret") == {}
    assert "treadle-local-secret" not in text


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod template of the manifests, by workload (and PyTorchJob replica)."""
    pods = {}
    for kind in ("Deployment", "StatefulSet"):
        for name, workload in kinds(docs, kind).items():
            pods[name] = workload["spec"]["template"]["spec"]
    for name, job in kinds(docs, "PyTorchJob").items():
        for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
            pods[f"{name}/{role}"] = spec["template"]["spec"]
    return pods


PROFILE = "deploy/seccomp/env-gateway.json"


def test_the_gateways_seccomp_profile_is_the_rendered_one_and_refuses_the_deny_list():
    """The committed profile is `container_profile()`'s: everything the sandbox denies its
    code fails with EPERM in the gateway's container, except what makes a box."""
    from treadle_env_gateway.sandbox.seccomp import BOX_MAKING, DENIED, container_profile

    committed = json.loads((ROOT / PROFILE).read_text())
    assert committed == container_profile()
    [rule] = committed["syscalls"]
    assert rule["action"] == "SCMP_ACT_ERRNO" and rule["errnoRet"] == 1
    assert set(rule["names"]) == set(DENIED) - set(BOX_MAKING)
    assert {"keyctl", "bpf", "ptrace", "io_uring_setup", "init_module"} <= set(rule["names"])


def test_every_pod_is_hardened(rendered):
    _, docs = rendered
    pods = pod_specs(docs)
    assert {"redis", "nats", "weight-store", "env-gateway", "reward", "rollout"} <= set(pods)
    for name, pod in pods.items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            what = f"{name}/{container['name']}"
            sec = container["securityContext"]
            if name.startswith("env-gateway"):  # bubblewrap's user namespaces, own /proc
                assert pod["hostUsers"] is False, what
                local = {"type": "Localhost", "localhostProfile": "treadle/env-gateway.json"}
                assert sec["seccompProfile"] == local, what
                assert sec["procMount"] == "Unmasked", what
            else:
                assert "seccompProfile" not in sec and "procMount" not in sec, what
            assert sec["allowPrivilegeEscalation"] is False, what
            assert sec["capabilities"] == {"drop": ["ALL"]}, what
            assert sec["readOnlyRootFilesystem"] is True, what
            if not name.startswith(("redis", "nats")):  # python: a writable /tmp
                mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
                assert "/tmp" in mounts, what


def test_every_network_path_names_its_peers(rendered):
    _, docs = rendered
    policies = kinds(docs, "NetworkPolicy")
    for name, policy in policies.items():
        spec = policy["spec"]
        for rule in spec.get("ingress", []):
            assert rule.get("from"), f"{name}: an ingress rule without from:"
        for rule in spec.get("egress", []):
            # only the weight-store's S3 (outside the cluster) is open by port alone
            assert rule.get("to") or name == "weight-store-egress-to-s3", name
    public = policies["public-apis"]["spec"]["ingress"]
    assert all(peer for rule in public for peer in rule["from"])
    # env-gateway runs untrusted code: it may reach NATS and DNS only
    gateway_egress = [
        n
        for n, p in policies.items()
        if "Egress" in p["spec"]["policyTypes"]
        and p["spec"].get("egress")
        and (
            p["spec"]["podSelector"] == {} or "env-gateway" in json.dumps(p["spec"]["podSelector"])
        )
    ]
    assert sorted(gateway_egress) == ["dns-egress", "services-egress-to-nats"]


def test_redis_and_nats_pods_require_the_credentials(rendered):
    _, docs = rendered
    sets = kinds(docs, "StatefulSet")
    redis = sets["redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][1:3] == ["--requirepass", "$(REDIS_PASSWORD)"]
    nats = sets["nats"]["spec"]["template"]["spec"]
    container = nats["containers"][0]
    assert container["args"][:2] == ["--config", "/etc/nats/nats.conf"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        infra_auth.password_env(u): {"name": "treadle-auth", "key": f"nats-password-{u}"}
        for u in infra_auth.NATS_USERS
    }
    [volume] = [v for v in nats["volumes"] if v["name"] == "config"]
    maps = kinds(docs, "ConfigMap")
    assert maps[volume["configMap"]["name"]]["data"]["nats.conf"] == infra_auth.render_nats_conf()


def test_gpu_overlay_requests_gpus_on_gpu_nodes():
    out = subprocess.run(
        [str(BIN / "kubectl"), "kustomize", str(ROOT / "k8s" / "overlays" / "gpu")],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    rollout = kinds(docs, "Deployment")["rollout"]["spec"]["template"]["spec"]
    assert rollout["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert rollout["containers"][0]["image"].startswith("treadle/rollout-gpu")
    assert rollout["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    job = kinds(docs, "PyTorchJob")["trainer"]["spec"]["pytorchReplicaSpecs"]
    assert job["Worker"]["replicas"] == 3
    for role in ("Master", "Worker"):
        pod = job[role]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["containers"][0]["image"].startswith("treadle/trainer-gpu")
    config = kinds(docs, "ConfigMap")["treadle-rollout-config"]["data"]
    assert config["TREADLE_ROLLOUT_ENGINE"] == "vllm"


def test_megatron_overlay_runs_tensor_parallel_ranks_within_a_pod():
    """gpu-megatron: 2 pods x 4 GPUs, torchrun starts one rank per GPU; the tensor-parallel
    size its recipes use (4) divides the 8 ranks and stays inside a pod."""
    from treadle_trainer.backends import check_backend

    _, docs = render("gpu-megatron")
    job = kinds(docs, "PyTorchJob")["trainer"]["spec"]
    per_pod = int(job["nprocPerNode"])
    replicas = job["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in replicas.values())
    assert (pods, per_pod) == (2, 4)
    for spec in replicas.values():
        container = spec["template"]["spec"]["containers"][0]
        assert container["command"] == ["torchrun", "-m", "treadle_trainer"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == per_pod
    overlay = (ROOT / "k8s" / "overlays" / "gpu-megatron" / "kustomization.yaml").read_text()
    assert "tensor_parallel: 4" in overlay
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(pods * per_pod)}):
        check_backend("megatron", 4, 1)  # what the overlay's recipes ask for fits


# --- TREADLE_* variables -------------------------------------------------------------------------
def manifest_vars(docs: list[dict]) -> set[str]:
    names: set[str] = set()
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            names |= set(doc.get("data", {}))
        elif doc["kind"] == "Secret":
            names |= set(doc.get("stringData", {})) | set(doc.get("data", {}))
    for container in re.findall(r"- name: (TREADLE_[A-Z0-9_]+)", yaml.safe_dump_all(docs)):
        names.add(container)
    return names


def test_every_variable_set_is_one_the_settings_class_reads(rendered):
    compose_env = {
        key
        for svc in compose_config("cpu", "gpu", "demo")["services"].values()
        for key in (svc.get("environment") or {})
    }
    docker_env = {
        word.split("=")[0]
        for path in [*ROOT.glob("services/*/Dockerfile*"), ROOT / "libs/cli/Dockerfile"]
        for keyword, args in instructions(path)
        if keyword == "ENV"
        for word in args.split()
        if word.startswith("TREADLE_")
    }
    _, docs = rendered
    treadle_vars = {v for v in compose_env | manifest_vars(docs) | docker_env if "TREADLE" in v}
    assert treadle_vars - SETTINGS_VARS == set(), "set but never read"
    # and what every service needs to find its infrastructure is set everywhere
    needed = {"TREADLE_REDIS_URL", "TREADLE_NATS_URL", "TREADLE_WEIGHT_STORE_ADDR"}
    assert needed <= manifest_vars(docs) and needed <= compose_env
    assert {"TREADLE_ROLLOUT_MODEL", "TREADLE_ROLLOUT_MODEL_NAME"} <= manifest_vars(docs)
    assert {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} <= compose_env  # minio's own


def test_each_service_is_given_only_settings_it_reads():
    """Per-service settings: a variable compose sets on a service is one that service's own
    settings class reads (not merely some other process's)."""
    services = compose_config("cpu")["services"]
    for name, settings in SERVICE_SETTINGS.items():
        given = {k for k in services[name].get("environment") or {} if k.startswith("TREADLE_")}
        assert given - variables(settings) == set(), name
    # and the common part is what every service reads
    assert all(variables(Settings) <= variables(s) for s in SERVICE_SETTINGS.values())


def test_treadle_secrets_feeds_compose_and_kubernetes(tmp_path):
    treadle = str(BIN / "treadle")
    env_lines = subprocess.run(
        [treadle, "secrets"], capture_output=True, text=True, check=True
    ).stdout
    (tmp_path / ".env").write_text(env_lines)
    bare = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_VARS)}
    rendered = subprocess.run(
        [str(COMPOSE), "-f", str(ROOT / "compose.yaml"), "--env-file", str(tmp_path / ".env")]
        + ["--profile", "cpu", "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=bare,
    )
    assert rendered.returncode == 0, rendered.stderr
    trainer = json.loads(rendered.stdout)["services"]["trainer"]["environment"]
    table = auth.TokenTable.parse(trainer["TREADLE_AUTH_TOKENS"], "compose")
    assert table.role_of(trainer["TREADLE_TOKEN"]) is auth.Role.trainer
    manifest = subprocess.run(
        [treadle, "secrets", "--format", "k8s", "--namespace", "treadle-dev"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    secret = yaml.safe_load(manifest)
    assert secret["metadata"] == {"name": "treadle-auth", "namespace": "treadle-dev"}
    table = auth.TokenTable.parse(secret["stringData"]["tokens.json"], "k8s")
    for role in auth.Role:
        assert table.role_of(secret["stringData"][role.value]) is role
    # every key the manifests read from it is there
    for overlay in OVERLAYS:
        wanted = secret_keys(render(overlay)[1], "treadle-auth")
        assert "redis-password" in wanted and "nats-password-reward" in wanted
        assert wanted <= set(secret["stringData"]), wanted - set(secret["stringData"])
    # two runs never give the same tokens
    again = subprocess.run([treadle, "secrets"], capture_output=True, text=True, check=True)
    assert set(again.stdout.splitlines()).isdisjoint(env_lines.splitlines())


# --- supply chain --------------------------------------------------------------------------------
LOCK_IMAGES = {
    "services/weight-store/Dockerfile": "weight-store",
    "services/env-gateway/Dockerfile": "env-gateway",
    "services/reward/Dockerfile": "reward",
    "services/rollout/Dockerfile": "rollout",
    "services/trainer/Dockerfile": "trainer",
    "libs/cli/Dockerfile": "cli",
}


def lock_entries(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (version, its hashes) of a pip lock file; every entry must carry hashes."""
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)", block)
        if not match:
            continue
        hashes = frozenset(re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
        assert hashes, f"{path.name}: {match.group(1)} has no hash"
        out[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = (match.group(2), hashes)
    return out


def test_ci_and_every_image_install_third_party_packages_only_by_hash():
    """`make setup` and each image install every third-party package from a lock that pins
    it with its files' hashes (`--require-hashes`), then our own packages without resolving
    anything more (`--no-deps`, no build isolation: the build backend is locked too), then
    `pip check`; an image's lock is the part of CI's (same versions, same hashes) its own
    packages need."""
    ci = lock_entries(ROOT / "requirements/ci.txt")
    assert {"torch", "hatchling", "editables", "grpcio", "fastapi", "redis"} <= set(ci)
    assert ci["torch"][0] == "2.13.0+cpu"
    makefile = (ROOT / "Makefile").read_text()
    hashed = "--require-hashes --no-deps --ignore-requires-python -r requirements/ci.txt"
    assert f"install --quiet {hashed}" in makefile  # megatron-core: see scripts/lock.py
    assert "--no-deps --no-build-isolation $(WORKSPACE)" in makefile
    assert "WORKSPACE := -e 'libs/common[hf]'" in makefile
    assert "$(PIP) check" in makefile
    for dockerfile, image in LOCK_IMAGES.items():
        lock = lock_entries(ROOT / f"requirements/images/{image}.txt")
        assert lock and all(ci[name] == entry for name, entry in lock.items()), image
        steps = " ".join(a for k, a in instructions(ROOT / dockerfile) if k == "RUN")
        assert "--require-hashes --no-deps" in steps and "-r /src/requirements.txt" in steps
        assert "pip install --no-deps --no-build-isolation" in steps and "pip check" in steps
        copies = [a for k, a in instructions(ROOT / dockerfile) if k == "COPY"]
        assert f"requirements/images/{image}.txt /src/requirements.txt" in copies, dockerfile
        # what its own packages ask for is in its lock (pip check proves it in the build)
        wanted = {"grpcio", "pydantic", "redis"} if image != "cli" else {"typer", "grpcio"}
        assert wanted <= set(lock), image
    setups = (("setup_vllm.sh", "vllm"), ("setup_cookbook.sh", "cookbook"))
    for setup, lock_file in (*setups, ("setup_verifiers.sh", "verifiers")):
        text = (ROOT / "scripts" / setup).read_text()
        assert f"LOCK=requirements/{lock_file}.txt" in text and "--require-hashes --no-deps" in text
        assert lock_entries(ROOT / f"requirements/{lock_file}.txt"), lock_file
