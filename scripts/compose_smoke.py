#!/usr/bin/env python3
"""`docker compose` end to end, for real: build every image, bring the stack up, run a short
recipe as two LoRA runs at once (two `demo` containers, one stack, one base model) while a
service process is SIGKILLed and redis restarts, check both runs' summaries, then tear
everything down and check nothing is left. Prints one
JSON report; exits 0 only when every check held.

    python scripts/compose_smoke.py [--keep]     (needs a Docker engine; run as root in CI)

Where registries cannot be reached (CI here) it builds a local Python base
(`scripts/docker_base.sh`) and uses `deploy/compose/local-infra.yaml` (redis, nats and S3
from Debian packages and PyPI). Package sources come from the environment, defaulting to
the public ones: TREADLE_PIP_INDEX_URL, TREADLE_TORCH_INDEX_URL, and pip's own
find-links (environment or config; a local wheel directory is served to the builds over
loopback); a CA bundle for a TLS-inspecting proxy (TREADLE_BUILD_CA_FILE, else pip's `cert`)
goes in as a build secret. Exit code 77: no Docker engine here (the pytest wrapper skips).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support import hostile  # noqa: E402  (the hostile programs the stress test runs too)

PROJECT = "treadle-smoke"
SERVICES = ["redis", "nats", "minio", "weight-store", "env-gateway", "reward", "rollout", "trainer"]
TREADLE_SERVICES = ["weight-store", "env-gateway", "reward", "rollout", "trainer"]
IMAGES = ["cli", "weight-store", "env-gateway", "reward", "rollout", "trainer"]
PUBLIC_BASE = "python:3.11-slim-bookworm"
TAG = "0.1.0"
"""The images' tag: compose's `TREADLE_IMAGE_TAG` default, the package version (never
`latest`: k8s names the same tag)."""
WHEELS_PORT = 38471
RECIPE_STEPS = 36  # recipes/compose_smoke.yaml's trainer.num_steps
SCALE = {"rollout": 3, "reward": 2}
"""Replicas of the scaled services, as `deploy/compose/scale.yaml` sets them: each its own
consumer."""
RUNS = ("smoke-a", "smoke-b")
"""Two LoRA runs of the recipe at once on the one stack, one base model (different seeds)."""
RUN_SETS = ("--set", "trainer.lora.rank=8", "--set", "trainer.lr=1.0e-4")
SKIP = 77
SANDBOX_CHECK = """
import asyncio, pathlib
from treadle_env_gateway.sandbox.runner import Sandbox
from treadle_env_gateway.settings import EnvGatewaySettings
s = EnvGatewaySettings()
base = pathlib.Path('/var/lib/treadle/sandbox')
box = Sandbox(base, backend=s.env_sandbox, image=s.env_sandbox_image)
r = asyncio.run(box.run_tests('def add(a, b):\\n    return a + b\\n', 'assert add(2, 3) == 5'))
print(r.backend, r.status, r.verdict, r.stderr[-300:].replace('\\n', ' '))
"""

STRESS_CHECK = """
import asyncio, json, os, sys
from treadle_common.clients.env import EnvClient
HOSTILE, RIGHT, TASK = json.loads(sys.argv[1])
async def play(client, code, timeout_s):
    session = await client.create('python_tests', TASK, options={'timeout_s': timeout_s})
    step = await client.step(session.session_id, text='```python' + chr(10) + code + '```')
    return json.loads(step.info_json)['sandbox'], step.status, step.reward
async def main():
    client = EnvClient('127.0.0.1:50052', token=os.environ['STRESS_TOKEN'])
    kinds = [k for k in HOSTILE for _ in range(4)]
    runs = [play(client, HOSTILE[k], 5.0) for k in kinds]
    runs += [play(client, RIGHT, 60.0) for _ in range(8)]
    results = await asyncio.gather(*runs)
    hostile = [[k, *r] for k, r in zip(kinds, results)]
    print(json.dumps({'hostile': hostile, 'honest': results[16:]}))
asyncio.run(main())
"""
"""16 hostile programs and 8 honest runs at once through the env-gateway container's own gRPC
API (run inside it, with the rollout token): the container is capped at 2 GiB."""


def log(message: str) -> None:
    print(f"[compose-smoke {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sh(*args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:6])} -> {result.returncode}: {result.stderr[-3000:]}")
    return result


def compose_binary() -> list[str]:
    here = Path(sys.executable).parent / "docker-compose"
    if here.exists():
        return [str(here)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


class Stack:
    def __init__(self, files: list[Path], env_files: list[Path], env: dict[str, str]):
        self.base = [*compose_binary(), "-p", PROJECT]
        for f in files:
            self.base += ["-f", str(f)]
        for f in env_files:
            self.base += ["--env-file", str(f)]
        self.env = {**os.environ, **env, "COMPOSE_PROFILES": "cpu"}

    def __call__(self, *args: str, check: bool = True, timeout: float = 900):
        return sh(*self.base, *args, check=check, timeout=timeout, env=self.env, cwd=ROOT)

    def popen(self, *args: str, out) -> subprocess.Popen:
        return subprocess.Popen(
            [*self.base, *args], stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
        )

    def container(self, service: str) -> str:
        """The service's first replica."""
        return self.containers(service)[0]

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).stdout.split()


def engine_available() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI"
    probe = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                           capture_output=True, text=True)  # fmt: skip
    return None if probe.returncode == 0 else f"no Docker engine: {probe.stderr.strip()[-200:]}"


def can_pull(image: str) -> bool:
    if sh("docker", "image", "inspect", image, check=False).returncode == 0:
        return True
    return sh("docker", "pull", image, check=False, timeout=300).returncode == 0


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=10)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def wheel_server(directory: str):
    """Serve a local wheel directory to the builds (host network) on a loopback port."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002
            pass

    handler = functools.partial(Quiet, directory=directory)
    try:  # a fixed port when free: the URL is a build argument, so it keeps the layer cache
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


def pip_config() -> dict[str, str]:
    """This machine's pip settings (environment and config files: `find-links`, `cert`),
    which the builds mirror: a local wheel directory, a TLS-inspecting proxy's CA."""
    listed = sh(sys.executable, "-m", "pip", "config", "list", check=False).stdout
    found: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("find-links", "cert") and value:
            found[name] = value.strip("'\"").split()[0]
    return found


def build_env(report: dict) -> tuple[dict[str, str], list[Path], contextlib.ExitStack]:
    """Images' base, package sources and the compose files for this machine."""
    env: dict[str, str] = {}
    files = [ROOT / "compose.yaml", ROOT / "deploy" / "compose" / "scale.yaml"]
    stack = contextlib.ExitStack()
    local = not can_pull(PUBLIC_BASE)
    if local:  # no registry: a base from Debian packages, and infra images built here
        env["TREADLE_PYTHON_IMAGE"] = sh(str(ROOT / "scripts" / "docker_base.sh"),
                                         timeout=900).stdout.strip()  # fmt: skip
        files.append(ROOT / "deploy" / "compose" / "local-infra.yaml")
    torch_index = os.environ.get("TREADLE_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    pip_index = os.environ.get("TREADLE_PIP_INDEX_URL", "https://pypi.org/simple")
    if not reachable(torch_index.rstrip("/") + "/torch/"):
        log(f"torch index {torch_index} unreachable: torch from {pip_index} and local wheels")
        torch_index = pip_index
    env["TREADLE_TORCH_INDEX_URL"], env["TREADLE_PIP_INDEX_URL"] = torch_index, pip_index
    pip = pip_config()
    wheels = os.environ.get("TREADLE_WHEELS_URL") or pip.get("find-links", "")
    if wheels and os.path.isdir(wheels):
        wheels = stack.enter_context(wheel_server(wheels))
    if wheels:
        env["TREADLE_WHEELS_URL"] = wheels
    ca = os.environ.get("TREADLE_BUILD_CA_FILE") or pip.get("cert", "")
    if ca and os.path.isfile(ca):
        env["TREADLE_BUILD_CA_FILE"] = ca
    socket_path = "/var/run/docker.sock"
    if os.path.exists(socket_path):
        env["DOCKER_GID"] = str(os.stat(socket_path).st_gid)
    report["base_image"] = env.get("TREADLE_PYTHON_IMAGE", PUBLIC_BASE)
    report["local_infra"] = local
    return env, files, stack


def secrets_file(directory: Path) -> tuple[Path, dict[str, str]]:
    path = directory / "secrets.env"
    treadle = Path(sys.executable).parent / "treadle"
    out = sh(str(treadle) if treadle.exists() else "treadle", "secrets", "--format", "env")
    path.write_text(out.stdout)
    pairs = (line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    return path, {k.strip(): v.strip() for k, v in pairs}


def health(stack: Stack) -> dict[str, str]:
    rows = stack("ps", "--format", "json", "--all").stdout
    parsed = [json.loads(line) for line in rows.splitlines() if line.strip().startswith("{")]
    if len(parsed) == 1 and isinstance(parsed[0], list):
        parsed = parsed[0]
    states: dict[str, str] = {}
    for r in parsed:  # a scaled service: healthy when every replica is
        state = r.get("Health") or r.get("State", "")
        if states.get(r["Service"], "healthy") == "healthy":
            states[r["Service"]] = state
    return states


def trainer_steps(token: str) -> dict[str, int] | None:
    """Each run's step, from the trainer's published API (None: no answer)."""
    request = urllib.request.Request(
        "http://127.0.0.1:8005/v1/runs", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            runs = json.load(answer)
    except Exception:
        return None
    return {r["run_id"]: r.get("step", 0) for r in runs}


def wait_for_step(token: str, step: int, demos: dict[str, subprocess.Popen],
                  timeout_s: float = 900) -> int:  # fmt: skip
    """Until every run reaches `step` (the least of their steps); fails if a demo ends first
    (a fault must land while both run)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for run_id, demo in demos.items():
            if demo.poll() is not None:
                raise RuntimeError(f"{run_id} ended (rc {demo.returncode}) before step {step}")
        steps = trainer_steps(token) or {}
        now = min((steps.get(run_id, 0) for run_id in demos), default=0)
        if now >= step:
            return now
        time.sleep(0.5)
    raise RuntimeError(
        f"the runs did not reach step {step} in {timeout_s}s: {trainer_steps(token)}"
    )


def kill_process(stack: Stack, service: str) -> int:
    """SIGKILL the service's main process from the host (a crash, not `docker kill`, so the
    restart policy brings it back)."""
    cid = stack.container(service)
    pid = int(sh("docker", "inspect", "-f", "{{.State.Pid}}", cid).stdout.strip())
    os.kill(pid, 9)
    return pid


def wait_healthy(stack: Stack, services: list[str], timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        states = health(stack)
        if all(states.get(s) == "healthy" for s in services):
            return time.monotonic() - started
        time.sleep(2)
    raise RuntimeError(f"not healthy after {timeout_s}s: {health(stack)}")


def smoke(report: dict, keep: bool) -> None:
    checks: dict[str, bool] = report.setdefault("checks", {})
    env, files, sources = build_env(report)
    with sources, tempfile.TemporaryDirectory() as tmp:
        secrets_path, secrets = secrets_file(Path(tmp))
        stack = Stack(files, [ROOT / ".env.example", secrets_path], env)
        stack("config", "-q")
        try:
            build_images(stack, report, checks)
            bring_up(stack, report, checks)
            besiege_the_sandbox(stack, secrets["TREADLE_TOKEN_ROLLOUT"], report, checks)
            run_the_image_as_kubernetes_does(report, checks)
            two_runs_under_faults(stack, secrets["TREADLE_TOKEN_ADMIN"], tmp, report)
        finally:
            if not keep:
                take_down(stack, report, checks)


def build_images(stack: Stack, report: dict, checks: dict[str, bool]) -> None:
    """Every image, from this tree (each holds this tree's lock for it); their sizes."""
    t = time.monotonic()
    log("building every image")
    stack("build", timeout=3600)
    report["build_s"] = round(time.monotonic() - t, 1)
    sizes = sh("docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}")
    report["image_sizes"] = {
        name: size
        for name, size in (line.split() for line in sizes.stdout.splitlines())
        if name.split(":")[0] in {f"treadle/{i}" for i in IMAGES} | {"treadle/infra"}
    }
    # each image was built from this tree: it holds this tree's lock for it
    stale = [
        image
        for image in IMAGES
        if sh("docker", "run", "--rm", "--entrypoint", "cat", f"treadle/{image}:{TAG}",
              "/opt/treadle/requirements.txt", check=False).stdout
        != (ROOT / "requirements" / "images" / f"{image}.txt").read_text()
    ]  # fmt: skip
    report["images_not_from_this_tree"] = stale
    checks["images_built_from_this_trees_locks"] = not stale
    cli = sh("docker", "run", "--rm", f"treadle/cli:{TAG}", "--help", check=False)
    checks["cli_image_runs_treadle"] = cli.returncode == 0 and "run" in cli.stdout


def bring_up(stack: Stack, report: dict, checks: dict[str, bool]) -> None:
    """`docker compose up -d --wait`: every service healthy, non-root, scaled."""
    t = time.monotonic()
    log("docker compose up -d --wait")
    stack("up", "-d", "--wait", "--wait-timeout", "600", timeout=900)  # scale.yaml
    wait_healthy(stack, SERVICES, 300)
    report["up_s"] = round(time.monotonic() - t, 1)
    states = health(stack)
    report["health"] = states
    checks["every_service_healthy"] = all(states.get(s) == "healthy" for s in SERVICES)
    users = {
        s: stack("exec", "-T", s, "id", "-u", check=False).stdout.strip() for s in TREADLE_SERVICES
    }
    report["service_uids"] = users
    checks["services_run_as_non_root"] = all(u not in ("", "0") for u in users.values())
    replicas = {service: len(stack.containers(service)) for service in SCALE}
    report["replicas"] = replicas
    checks["replicas_scaled"] = replicas == SCALE


def besiege_the_sandbox(stack: Stack, token: str, report: dict, checks: dict[str, bool]) -> None:
    """The env-gateway judges in a bwrap sandbox in its container, survives hostile programs
    in its 2 GiB (compose's mem_limit), and holds no Docker socket."""
    sandbox = stack("exec", "-T", "env-gateway", "python", "-c", SANDBOX_CHECK, check=False)
    report["env_gateway_sandbox"] = (sandbox.stdout + sandbox.stderr).strip()[-500:]
    checks["env_gateway_sandbox_judges_in_a_container"] = sandbox.stdout.startswith("bwrap ok pass")
    programs = json.dumps([hostile.HOSTILE, hostile.RIGHT, hostile.TASK])
    siege = stack("exec", "-T", "-e", f"STRESS_TOKEN={token}", "env-gateway", "python", "-c",
                  STRESS_CHECK, programs, check=False, timeout=600)  # fmt: skip
    try:
        stress = json.loads(siege.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        stress = {"error": (siege.stdout + siege.stderr)[-1000:]}
    report["env_gateway_stress"] = stress
    checks["env_gateway_survives_sixteen_hostile_programs"] = (
        "error" not in stress
        and all(r[1] in hostile.ENDINGS and r[2] == "ok" for r in stress["hostile"])
        and all(r == ["ok", "ok", 1.0] for r in stress["honest"])
        and health(stack).get("env-gateway") == "healthy"
    )
    probe = "import os; print(os.path.exists('/var/run/docker.sock'))"
    socket = stack("exec", "-T", "env-gateway", "python", "-c", probe, check=False)
    checks["env_gateway_holds_no_docker_socket"] = socket.stdout.strip() == "False"


def run_the_image_as_kubernetes_does(report: dict, checks: dict[str, bool]) -> None:
    """The env-gateway image as Kubernetes runs it (k8s/base/env-gateway.yaml): non-root,
    read-only root, no capabilities, bwrap; with what its pod grants, and without."""
    pod = ["docker", "run", "--rm", "--read-only", "--tmpfs", "/tmp",
           "--tmpfs", "/var/lib/treadle:uid=10001", "--cap-drop", "ALL",
           "--security-opt", "no-new-privileges"]  # fmt: skip
    granted = ["--security-opt", f"seccomp={ROOT / 'deploy/seccomp/env-gateway.json'}",
               "--security-opt", "systempaths=unconfined"]  # fmt: skip
    image = [f"treadle/env-gateway:{TAG}", "python", "-c", SANDBOX_CHECK]
    k8s = sh(*pod, *granted, *image, check=False)
    bare = sh(*pod, *image, check=False)
    report["env_gateway_bwrap"] = {
        "granted": k8s.stdout.strip()[-300:] or k8s.stderr[-300:],
        "default_docker_profile": bare.stdout.strip()[-300:] or bare.stderr[-300:],
    }
    checks["env_gateway_image_bwrap_non_root"] = k8s.stdout.startswith("bwrap ok pass")
    checks["bwrap_fails_closed_where_not_granted"] = bare.stdout.startswith("bwrap sandbox_error")


def take_down(stack: Stack, report: dict, checks: dict[str, bool]) -> None:
    """`docker compose down -v`, then nothing of the project (or a sandbox) may be left."""
    log("docker compose down -v")
    profiles = ("--profile", "cpu", "--profile", "demo")  # the demo's volume too
    stack(*profiles, "down", "-v", "--remove-orphans", "--timeout", "20", check=False)
    left = sh("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}")
    volumes = sh(
        "docker",
        "volume",
        "ls",
        "-q",
        "--filter",
        f"label=com.docker.compose.project={PROJECT}",
    )
    sandboxes = sh("docker", "ps", "-aq", "--filter", "label=treadle.sandbox")
    report["left_behind"] = {
        "containers": left.stdout.split(),
        "volumes": volumes.stdout.split(),
        "sandbox_containers": sandboxes.stdout.split(),
    }
    checks["nothing_left_behind"] = not any(report["left_behind"].values())


def two_runs_under_faults(stack: Stack, token: str, tmp: str, report: dict) -> None:
    """Two LoRA runs of the recipe at once (two `demo` containers); the rollout's process
    SIGKILLed and redis restarted while both run; each run's summary checked."""
    checks: dict[str, bool] = report["checks"]
    log("two demo services run recipes/compose_smoke.yaml at once; faults under them")
    demos: dict[str, subprocess.Popen] = {}
    with contextlib.ExitStack() as outs:
        t = time.monotonic()
        outs.callback(stop_demos, demos)  # a demo still running when this block ends
        demos.update(
            {
                run_id: stack.popen(
                    "run",
                    "--rm",
                    "-T",
                    "demo",
                    "run",
                    "/opt/treadle/recipes/compose_smoke.yaml",
                    *RUN_SETS,
                    "--set",
                    f"run_id={run_id}",
                    "--set",
                    f"trainer.seed={seed}",
                    out=outs.enter_context((Path(tmp) / f"{run_id}.log").open("w")),
                )
                for seed, run_id in enumerate(RUNS)
            }
        )
        faults = []
        step = wait_for_step(token, 8, demos)
        faults.append({"killed": "rollout", "pid": kill_process(stack, "rollout"),
                       "at_step": step})  # fmt: skip
        step = wait_for_step(token, step + 12, demos)  # they went on after the kill
        stack("restart", "redis")
        faults.append({"restarted": "redis", "at_step": step})
        rcs = {run_id: demo.wait(timeout=1500) for run_id, demo in demos.items()}
        faults.append({"after_redis_restart_steps": trainer_steps(token)})
    report["demo_s"] = round(time.monotonic() - t, 1)
    report["faults"] = faults
    report["demo_tails"] = {
        run_id: (Path(tmp) / f"{run_id}.log").read_text()[-1500:] for run_id in RUNS
    }
    checks["demo_exit_0"] = all(rc == 0 for rc in rcs.values())
    check_runs(stack, report, checks)
    restarts = sh("docker", "inspect", "-f", "{{.RestartCount}}",
                  stack.container("rollout")).stdout.strip()  # fmt: skip
    report["rollout_restarts"] = int(restarts or 0)
    checks["killed_service_came_back"] = int(restarts or 0) >= 1
    checks["faults_landed_mid_run"] = (
        all(f.get("at_step", 0) < RECIPE_STEPS for f in faults[:2]) and len(faults) == 3
    )


def check_runs(stack: Stack, report: dict, checks: dict[str, bool]) -> None:
    """Each run's summary.json: succeeded exactly once, with its own versions, its adapter
    live in rollout and its own export."""
    summaries = {run_id: read_summary(stack, run_id) for run_id in RUNS}
    report["summaries"] = {
        run_id: {
            k: summary.get(k)
            for k in (
                "state",
                "steps",
                "exactly_once",
                "versions_published",
                "weight_store_versions",
                "rollout_policy_version",
                "dropped",
                "reconnects",
                "trajectories_produced",
                "trajectories_trained",
                "final_model_dir",
                "error",
            )
        }
        for run_id, summary in summaries.items()
    }
    every = summaries.values()
    checks["run_succeeded"] = all(s.get("state") == "succeeded" for s in every)
    checks["exactly_once"] = all(s.get("exactly_once") is True for s in every)
    checks["versions_published"] = all(len(s.get("weight_store_versions") or []) > 1 for s in every)
    # each run's adapter went to rollout past its first version (live, per run)
    checks["rollout_swapped"] = all((s.get("rollout_policy_version") or 0) > 1 for s in every)
    checks["each_run_exported_its_adapter"] = all(
        str(s.get("final_model_dir") or "").endswith(f"{run_id}/final-model")
        for run_id, s in summaries.items()
    )


def stop_demos(demos: dict[str, subprocess.Popen]) -> None:
    for demo in demos.values():
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def read_summary(stack: Stack, run_id: str) -> dict:
    """summary.json of the run, from the demo's volume."""
    found = stack(
        "run", "--rm", "-T", "--no-deps", "--entrypoint", "sh", "demo", "-c",
        f"cat /var/lib/treadle/.treadle/runs/{run_id}/summary.json",
        check=False,
    )  # fmt: skip
    try:
        return json.loads(found.stdout)
    except ValueError:
        return {"error": f"no summary.json: {found.stdout[-500:]} {found.stderr[-500:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the stack up afterwards")
    args = parser.parse_args()
    if reason := engine_available():
        print(json.dumps({"skipped": reason}))
        return SKIP
    report: dict = {}
    started = time.monotonic()
    try:
        smoke(report, args.keep)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["total_s"] = round(time.monotonic() - started, 1)
    report["ok"] = "error" not in report and all(report.get("checks", {}).values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
