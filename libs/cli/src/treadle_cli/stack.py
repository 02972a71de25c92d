"""`treadle up / down / status`: infrastructure plus the five services as supervised processes.

    treadle up [--detach]
      -> Infra.up (redis, nats[, s3]) -> the model directory rollout serves
      -> Supervisor: `python -m treadle_<service>` per service, env TREADLE_*, logs in
         {state_dir}/logs/<service>.log; a crashed service is restarted (bounded retries)
      -> {state_dir}/stack.json records every pid, port and restart (read by status/down)
    treadle status [--json]  probes every service's /readyz and every infra URL
    treadle down             SIGTERM the supervisor (it drains services in reverse order),
                             then makes sure every pid it recorded is gone

`python -m treadle_cli.stack SPEC.json` runs a supervisor (what `up --detach` starts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from treadle_cli.infra import Infra, alive, port_free, probe, terminate
from treadle_cli.settings import CliSettings, admin_token_file, auth_dir
from treadle_common import names
from treadle_common.api.ops import Readiness, ServiceInfo, StageProgress
from treadle_common.api.rollout import RolloutInfo
from treadle_common.api.runs import RunStatus, Usage
from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.auth import tls
from treadle_common.auth.infra import InfraSecrets, redact
from treadle_common.clients.http import ApiError, info, readiness
from treadle_common.clients.trainer import TrainerClient


class StackError(RuntimeError):
    pass


@dataclass
class StackSpec:
    state_dir: str
    cwd: str
    redis_url: str
    nats_url: str
    model_dir: str
    model_name: str
    ports: dict[str, dict[str, int]]
    infra_started: list[str] = field(default_factory=list)
    max_restarts: int = 3
    host: str = "127.0.0.1"
    auth_tokens_file: str | None = None
    """The services' token table (None: auth off); each service presents its role's token."""
    infra_secrets_file: str | None = None
    """The passwords of the redis/nats this stack started (`Infra.secrets`)."""
    secured_infra: list[str] = field(default_factory=list)
    """Which of redis/nats need those passwords (the ones this state directory started)."""
    path_roots: list[str] = field(default_factory=list)
    """Where the trainer lets clients name paths, beside the state dir and `cwd`."""
    trainer_ranks: int = 1
    """Processes the trainer runs as (`torchrun`; rank 0 serves): megatron's tensor-parallel
    ranks, or FSDP2's."""
    served: dict[str, str] = field(default_factory=dict)
    """More models rollout serves, one replica each (`up --serve NAME=DIR`): weight-store
    name -> model directory; supervised as `rollout-NAME`."""
    rollout_python: str | None = None
    """The interpreter rollout and its replicas run under (None: the CLI's), e.g. the vLLM
    venv's (`TREADLE_ROLLOUT_PYTHON`)."""
    owner_pid: int | None = None
    """The process whose stack this is (`treadle run`'s own, a bench's): when it is gone,
    however it ended, the supervisor stops the stack. None: a stack of its own (`up`)."""

    def processes(self) -> list[str]:
        """Every supervised process: the five services, then a rollout replica per extra
        model."""
        return [*names.SERVICES, *(replica_name(m) for m in self.served)]

    @staticmethod
    def kind(process: str) -> str:
        """The service a supervised process runs (`rollout-NAME` is a rollout)."""
        return "rollout" if process.startswith("rollout-") else process

    def rollout_urls(self) -> dict[str, str]:
        """Model name -> the HTTP URL of the rollout replica that serves it."""
        urls = {self.model_name: self.http_url("rollout")}
        return urls | {m: self.http_url(replica_name(m)) for m in self.served}

    def command(self, service: str) -> list[str]:
        """How `service` is started: `python -m MODULE`, the trainer under `torchrun` when it
        has several ranks."""
        module = names.module_of(self.kind(service))
        if service == "trainer" and self.trainer_ranks > 1:
            ranks = str(self.trainer_ranks)
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            return [*run, "--nproc-per-node", ranks, "-m", module]
        if self.kind(service) == "rollout" and self.rollout_python:
            return [self.rollout_python, "-m", module]
        return [sys.executable, "-m", module]

    def client_url(self, name: str, user: str = infra_auth.ADMIN) -> str:
        """The URL of `name` (redis | nats) with `user`'s credentials where they are needed."""
        url = self.redis_url if name == "redis" else self.nats_url
        if name not in self.secured_infra or self.infra_secrets_file is None:
            return url
        secrets = InfraSecrets.load(Path(self.infra_secrets_file))
        return secrets.redis_url(url, user) if name == "redis" else secrets.nats_url(url, user)

    @staticmethod
    def ports_from(base_port: int | None) -> dict[str, dict[str, int]]:
        if base_port is None:
            return {s: dict(p) for s, p in names.DEFAULT_PORTS.items()}
        ports: dict[str, dict[str, int]] = {}
        nxt = base_port
        for service in names.SERVICES:
            ports[service] = {}
            for kind in names.DEFAULT_PORTS[service]:
                ports[service][kind] = nxt
                nxt += 1
        return ports

    def env(self, process: str) -> dict[str, str]:
        ports, service = self.ports, self.kind(process)
        model_dir, model_name = self.model_dir, self.model_name
        for name, path in self.served.items():
            if process == replica_name(name):
                model_dir, model_name = path, name
        env = {
            **passed_environment(service),
            "TREADLE_STATE_DIR": self.state_dir,
            "TREADLE_NATS_URL": self.client_url("nats", service),
            "TREADLE_HOST": self.host,
            "TREADLE_WEIGHT_STORE_ADDR": self.grpc_addr("weight-store"),
            "TREADLE_ENV_GATEWAY_ADDR": self.grpc_addr("env-gateway"),
            "TREADLE_ROLLOUT_MODEL": model_dir,
            "TREADLE_ROLLOUT_MODEL_NAME": model_name,
            "TREADLE_HTTP_PORT": str(self.port(process, "http")),
            "TREADLE_INSTANCE": f"{process}-local",
        }
        # the services share this machine's cores: OpenMP workers that spin while idle would
        # take them from the other services (override by setting it yourself). The trainer's
        # spin briefly (about 0.1 ms): a small model's training step is thousands of short
        # kernels, and waking a sleeping team for each cost a sync step 10 to 15 ms
        # (`treadle bench step`); libgomp's default spin is 100 times longer
        if service in infra_auth.REDIS_SERVICES:  # its own Redis user; the others get none
            env["TREADLE_REDIS_URL"] = self.client_url("redis", service)
        if service == "trainer":
            env.setdefault("GOMP_SPINCOUNT", "2000")
        else:
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if service == "trainer":
            # the trainer's own thread count (`TREADLE_TRAINER_TORCH_THREADS`), else split
            # between its lanes (runs' steps side by side)
            lanes = int(env.get("TREADLE_TRAINER_TORCH_LANES") or 1)
            threads = env.get("TREADLE_TRAINER_TORCH_THREADS") or (
                str(max(1, (os.cpu_count() or 2) // lanes)) if lanes > 1 else None
            )
            if threads:
                env["TREADLE_TORCH_THREADS"] = threads
        if service == "trainer":  # where recipes may name models, data and outputs
            roots = [self.state_dir, self.cwd, *self.path_roots]
            env.setdefault("TREADLE_TRAINER_PATH_ROOTS", json.dumps(roots))
            # the Tinker API trains LoRA adapters on the stack's model and samples them
            # through the stack's rollout
            env.setdefault(
                "TREADLE_TRAINER_TINKER_MODELS", json.dumps({self.model_name: self.model_dir})
            )
            env.setdefault("TREADLE_TRAINER_ROLLOUT_URL", self.http_url("rollout"))
        if service == "rollout":  # generation and training share the cores (async runs)
            env.setdefault("TREADLE_TORCH_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
            # the engine computes on its cores, rollout's serving threads on the others
            env.setdefault("TREADLE_ROLLOUT_ENGINE_CPUS", "auto")
        env.update(self.auth_env(service))
        env.pop("TREADLE_GRPC_PORT", None)
        if "grpc" in ports[process]:
            env["TREADLE_GRPC_PORT"] = str(self.port(process, "grpc"))
        return env

    def auth_env(self, service: str) -> dict[str, str]:
        """The token table `service` checks callers against and the token it presents."""
        if self.auth_tokens_file is None:
            return {"TREADLE_AUTH": "off"}
        path = Path(self.auth_tokens_file)
        table = auth.TokenTable.parse(path.read_text(), str(path))
        token = table.token_of(auth.SERVICE_ROLES[service])
        hashed = Path(self.state_dir) / "auth" / "tokens.hashed.json"  # what servers hold
        if not hashed.exists():
            raw = json.loads(path.read_text())
            auth.write_private(hashed, json.dumps(auth.TokenTable.hashed(raw), indent=2))
        return {
            "TREADLE_AUTH_TOKENS_FILE": str(hashed),
            **({"TREADLE_TOKEN": token} if token else {}),
        }

    def http_url(self, service: str) -> str:
        return f"http://{self.host}:{self.port(service, 'http')}"

    def grpc_addr(self, service: str) -> str:
        return f"{self.host}:{self.port(service, 'grpc')}"

    def port(self, service: str, kind: str) -> int:
        """`service`'s port for `kind` (`http` | `grpc`); KeyError names what it lacks."""
        return self.ports[service][kind]


_PASSED = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "TERM", "VIRTUAL_ENV"}
_PASSED |= {"PYTHONPATH", "PYTHONUNBUFFERED", "LD_LIBRARY_PATH", "SSL_CERT_FILE"}
_PASSED |= {"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}
_PASSED_PREFIXES = (
    "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "CUDA_", "NCCL_", "NVIDIA_", "HF_",
    "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "VLLM_", "XDG_", "HTTP_PROXY",
    "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "TREADLE_",
)  # fmt: skip
"""What of the environment `treadle up` passes its services: the runtime's (paths, locale,
threads, accelerators, caches, proxies) and the TREADLE_* settings, not the rest of the
caller's shell (a cloud key, another tool's token)."""
_OWN_SECRETS = {
    "TREADLE_S3_ACCESS_KEY": {"weight-store"},
    "TREADLE_S3_SECRET_KEY": {"weight-store"},
    "TREADLE_JUDGE_API_KEY": {"reward"},
    "TREADLE_ROLLOUT_OPENAI_API_KEY": {"rollout"},
}
"""Settings that are one service's secret: the others never get them."""
_CALLERS_OWN = {"TREADLE_TOKEN", "TREADLE_TOKEN_FILE", "TREADLE_AUTH_TOKENS"}
_CALLERS_OWN |= {"TREADLE_AUTH_TOKENS_FILE", "TREADLE_REDIS_URL", "TREADLE_NATS_URL"}
"""The caller's own token, table and transport credentials: each service gets its own
(`auth_env`, `client_url`)."""


def passed_environment(service: str) -> dict[str, str]:
    """The part of this process's environment that `service` gets (`_PASSED`)."""
    return {
        key: value
        for key, value in os.environ.items()
        if (key in _PASSED or key.startswith(_PASSED_PREFIXES))
        and key not in _CALLERS_OWN
        and service in _OWN_SECRETS.get(key, {service})
    }


def replica_name(model: str) -> str:
    """The supervised process of the rollout replica that serves `model` (`up --serve`)."""
    return f"rollout-{model}"


def stack_file(state_dir: Path) -> Path:
    return state_dir / "stack.json"


class ServiceRecord(BaseModel):
    """One supervised service in `stack.json`."""

    pid: int | None
    state: str = Field(description="starting | running | restarting | failed | stopped")
    restarts: int = 0
    last_exit: int | None = None


class StackRecord(BaseModel):
    """`{state_dir}/stack.json`, written by the supervisor: what `status` and `down` read."""

    supervisor_pid: int
    spec: StackSpec
    services: dict[str, ServiceRecord]


def read_stack(state_dir: Path) -> StackRecord | None:
    path = stack_file(state_dir)
    return StackRecord.model_validate_json(path.read_text()) if path.exists() else None


PROBE_EVERY_S = 5.0
"""How often the supervisor reads every service's /healthz."""


@dataclass
class Managed:
    name: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    wedged: int = 0  # times /healthz said it made no progress (it was restarted)
    state: str = "starting"  # starting | running | restarting | failed | stopped
    last_exit: int | None = None


class Supervisor:
    """Starts the services, restarts crashed ones (bounded), stops them all on SIGTERM."""

    def __init__(self, spec: StackSpec):
        self.spec = spec
        self.state_dir = Path(spec.state_dir)
        self.services = {name: Managed(name) for name in spec.processes()}
        self.stopping = False

    def _start(self, m: Managed) -> None:
        log_path = self.state_dir / "logs" / f"{m.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            m.proc = subprocess.Popen(
                self.spec.command(m.name),
                env=self.spec.env(m.name),
                cwd=self.spec.cwd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        m.state = "running"

    def write(self) -> None:
        record = StackRecord(
            supervisor_pid=os.getpid(),
            spec=self.spec,
            services={
                m.name: ServiceRecord(
                    pid=m.proc.pid if m.proc else None,
                    state=m.state,
                    restarts=m.restarts,
                    last_exit=m.last_exit,
                )
                for m in self.services.values()
            },
        )
        tmp = stack_file(self.state_dir).with_suffix(".tmp")
        tmp.write_text(record.model_dump_json(indent=2))
        tmp.replace(stack_file(self.state_dir))

    def start_all(self) -> None:
        for m in self.services.values():
            self._start(m)
        self.write()

    def probe(self) -> None:
        """Stop a service whose /healthz says it is wedged (503: a stage it alone can advance
        made no progress for TREADLE_LIVENESS_STALL_S); `poll` then restarts it."""
        for m in self.services.values():
            if m.proc is None or m.state != "running" or m.proc.poll() is not None:
                continue
            try:
                code = http().get(f"{self.spec.http_url(m.name)}/healthz", timeout=2.0).status_code
            except httpx.HTTPError:
                continue  # starting, or busy: only a clear 503 restarts it
            if code == 503:
                m.wedged += 1
                terminate(m.proc.pid, timeout_s=25.0)

    def poll(self) -> None:
        """Restart services that exited, up to `max_restarts` each."""
        changed = False
        for m in self.services.values():
            if m.proc is None or m.state == "failed" or m.proc.poll() is None:
                continue
            m.last_exit = m.proc.returncode
            changed = True
            if m.restarts >= self.spec.max_restarts:
                m.state = "failed"
                continue
            m.restarts += 1
            self._start(m)
        if changed:
            self.write()

    def stop_all(self) -> None:
        self.stopping = True
        for m in reversed(list(self.services.values())):
            if m.proc is not None and m.proc.poll() is None:
                terminate(m.proc.pid, timeout_s=25.0)
            m.state = "stopped"
        if self.spec.infra_started:
            settings = CliSettings(
                state_dir=Path(self.spec.state_dir),
                redis_url=self.spec.redis_url,
                nats_url=self.spec.nats_url,
            )
            Infra(settings).down()
        stack_file(self.state_dir).unlink(missing_ok=True)

    def run_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self.start_all()
        probed = time.monotonic()
        while not self.stopping:
            if self.spec.owner_pid is not None and not alive(self.spec.owner_pid):
                break  # its owner ended without stopping it (killed outright)
            self.poll()
            if time.monotonic() - probed > PROBE_EVERY_S:
                self.probe()
                probed = time.monotonic()
            time.sleep(0.5)
        self.stop_all()


# -- status ------------------------------------------------------------------------------
@functools.cache
def http(token: str | None = None) -> httpx.Client:
    """One client for every status poll: `httpx.get` builds a client (and an SSL context,
    ~20 ms of CPU) per call, which a 2-core machine running the stack feels.

    Pooled connections are dropped well before the services' keep-alive timeout: a request
    sent on a connection the server is closing at that moment fails with "connection reset"
    (seen: an SFT warm-up validating every ~5 s against uvicorn's 5 s timeout)."""
    return httpx.Client(
        limits=httpx.Limits(keepalive_expiry=names.HTTP_KEEPALIVE_S / 2),
        headers=auth.bearer(token),
        verify=tls.httpx_verify(),
    )


class InfraHealth(BaseModel):
    url: str
    healthy: bool
    detail: str


class ServiceHealth(BaseModel):
    pid: int | None
    alive: bool
    state: str
    restarts: int
    ports: dict[str, int]
    progress: dict[str, StageProgress] = Field(default_factory=dict)
    stalled: list[str] = Field(default_factory=list, description="Stages with work, no progress")
    ready: bool
    checks: dict[str, str]
    healthy: bool = Field(description="Its process is alive and /readyz says ready")
    last_error: str | None = Field(
        None, description="Unhealthy: the last error line of its log (why it is down)"
    )


class RolloutTime(BaseModel):
    """Rollout's side of where time goes (from its `/v1/info`)."""

    engine_busy_fraction: float
    policy_version: int
    version_lag: int
    admission_waits: int
    engine_requests: int


class RunTime(BaseModel):
    """A run's last 20 steps: the fractions of their time spent on each stage; the tasks
    rollout gave up on (dead letters, by reason), its quarantined episodes and the envs
    circuit-broken for it."""

    state: str
    step: int
    wait_for_batch_fraction: float
    train_fraction: float
    publish_fraction: float
    max_staleness: int
    tasks_dead: int = 0
    dead_lettered: dict[str, int] = Field(default_factory=dict)
    trajectories_quarantined: int = 0
    broken_envs: dict[str, str] = Field(default_factory=dict)
    tenant: str = "default"
    usage: Usage = Field(default_factory=Usage)

    @classmethod
    def of(cls, run: RunStatus) -> RunTime | None:
        steps = run.steps[-20:]
        total = sum(s.duration_s for s in steps)
        if not total:
            return None
        return cls(
            state=run.state,
            step=run.step,
            wait_for_batch_fraction=round(sum(s.wait_for_batch_s for s in steps) / total, 3),
            train_fraction=round(sum(s.train_s for s in steps) / total, 3),
            publish_fraction=round(sum(s.publish_s for s in steps) / total, 3),
            max_staleness=max(s.max_staleness for s in steps),
            tasks_dead=run.tasks_dead,
            dead_lettered=run.dead_lettered,
            trajectories_quarantined=run.trajectories_quarantined,
            broken_envs=run.broken_envs,
            tenant=run.tenant,
            usage=run.usage,
        )


class TimeBreakdown(BaseModel):
    """`treadle status` with detail: rollout's engine and each run's step stages."""

    rollout: RolloutTime | None = None
    runs: dict[str, RunTime] = Field(default_factory=dict, description="By run id")


class StackStatus(BaseModel):
    """`treadle status --json`: the stack `treadle up` started, service by service."""

    running: bool
    healthy: bool
    supervisor_pid: int | None = None
    infra: dict[str, InfraHealth] = Field(default_factory=dict)
    services: dict[str, ServiceHealth] = Field(default_factory=dict)
    stalled: dict[str, list[str]] = Field(default_factory=dict)
    unserved: dict[str, int] = Field(
        default_factory=dict,
        description="Models active runs need that no rollout replica of this stack serves: "
        "their tasks waiting (they wait until one does: `treadle up --serve NAME=DIR`)",
    )
    time: TimeBreakdown | None = Field(None, description="With detail: where the time goes")


def service_health(url: str) -> Readiness:
    try:
        return readiness(http(), url)
    except (httpx.HTTPError, ValueError) as exc:
        return Readiness(ready=False, checks={"http": f"unreachable: {exc}"})


def token_for(state_dir: Path) -> str | None:
    """The token to call the stack of `state_dir` with: `TREADLE_TOKEN[_FILE]`, else the admin
    token its `treadle up` wrote there."""
    return CliSettings(state_dir=state_dir).client_token()


def service_info(
    url: str, model: type[ServiceInfo] = ServiceInfo, token: str | None = None
) -> ServiceInfo | None:
    try:
        return info(http(token), url, model)
    except (httpx.HTTPError, ValueError, ApiError):
        return None


def time_breakdown(
    spec: StackSpec, rollout: RolloutInfo | None, token: str | None
) -> TimeBreakdown:
    """Where time goes: the trainer waiting for batches vs rollout generating or waiting."""
    try:
        runs = TrainerClient(spec.http_url("trainer"), http(token), timeout_s=2.0).list_runs()
    except (httpx.HTTPError, ValueError, ApiError):
        runs = []
    return TimeBreakdown(
        rollout=None if rollout is None else RolloutTime(**rollout.model_dump()),
        runs={run.run_id: time for run in runs if (time := RunTime.of(run)) is not None},
    )


_ERROR_LINE = re.compile(r"\bERROR\b|\[error|^\w+(\.\w+)*(Error|Exception): ")


def last_error(state_dir: Path, service: str, tail_bytes: int = 65536) -> str | None:
    """The last line of `service`'s log that reports an error (a logged ERROR, or the last
    line of a traceback), at most 500 characters."""
    path = state_dir / "logs" / f"{service}.log"
    try:
        with open(path, "rb") as log:
            log.seek(max(0, path.stat().st_size - tail_bytes))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.strip() for line in lines if _ERROR_LINE.search(line.strip())]
    return found[-1][:500] if found else None


def status(state_dir: Path, detail: bool = False) -> StackStatus:
    """Machine-readable health of the stack recorded in `state_dir`; with `detail`, also where
    the runs' time goes (reads every run's step records: for `treadle status`, not polling)."""
    record = read_stack(state_dir)
    if record is None:
        return StackStatus(running=False, healthy=False)
    spec = record.spec
    infra = {}
    for name, url in (("redis", spec.redis_url), ("nats", spec.nats_url)):
        why = probe(name, url)
        infra[name] = InfraHealth(url=redact(url), healthy=why is None, detail=why or "ok")
    services: dict[str, ServiceHealth] = {}
    rollout_info: RolloutInfo | None = None
    served: set[str] = set()
    token = token_for(state_dir)
    for name, svc in record.services.items():
        url = spec.http_url(name)
        health = service_health(url)
        kind = RolloutInfo if spec.kind(name) == "rollout" else ServiceInfo
        service = service_info(url, kind, token)
        if isinstance(service, RolloutInfo):
            served.add(service.model)
            rollout_info = service if name == "rollout" else rollout_info
        progress = service.progress if service is not None else {}
        up = svc.pid is not None and alive(svc.pid)
        services[name] = ServiceHealth(
            pid=svc.pid,
            alive=up,
            state=svc.state,
            restarts=svc.restarts,
            ports=spec.ports[name],
            progress=progress,
            stalled=sorted(stage for stage, p in progress.items() if p.stalled),
            ready=health.ready,
            checks=health.checks,
            healthy=up and health.ready,
            last_error=None if up and health.ready else last_error(state_dir, name),
        )
    healthy = all(i.healthy for i in infra.values()) and all(s.healthy for s in services.values())
    return StackStatus(
        running=True,
        healthy=healthy,
        supervisor_pid=record.supervisor_pid,
        infra=infra,
        services=services,
        stalled={n: s.stalled for n, s in services.items() if s.stalled},
        unserved=unserved_models(spec, served, token),
        time=time_breakdown(spec, rollout_info, token) if detail else None,
    )


def unserved_models(spec: StackSpec, served: set[str], token: str | None) -> dict[str, int]:
    """Models with tasks waiting that none of `served` is (the trainer's backlog by model)."""
    try:
        backlog = TrainerClient(spec.http_url("trainer"), http(token), timeout_s=2.0).backlog()
    except (httpx.HTTPError, ValueError, ApiError):
        return {}
    return {m: n for m, n in backlog.tasks_by_model.items() if m and m not in served}


def wait_healthy(state_dir: Path, timeout_s: float) -> StackStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(state_dir)
        if current.healthy or time.monotonic() > deadline:
            return current
        time.sleep(0.5)


# -- up / down ---------------------------------------------------------------------------
def free_ports(
    settings: CliSettings, base_port: int | None, serve: dict[str, Path]
) -> dict[str, dict[str, int]]:
    """Every process's ports (the services', then a block for each served model's replica),
    all of them free (else `StackError` names the one in use)."""
    ports = StackSpec.ports_from(base_port if base_port is not None else settings.base_port)
    for i, model in enumerate(serve, start=1):  # after every service's ports
        ports[replica_name(model)] = {k: p + 10 * i for k, p in ports["rollout"].items()}
    for service, kinds in ports.items():
        for kind, port in kinds.items():
            if not port_free(settings.host, port):
                raise StackError(f"port {port} ({service} {kind}) is already in use")
    return ports


def prepare(
    settings: CliSettings,
    model_dir: Path | None,
    model_name: str | None,
    base_port: int | None,
    with_s3: bool = False,
    path_roots: Sequence[Path] = (),
    trainer_ranks: int = 1,
    serve: dict[str, Path] | None = None,
) -> StackSpec:
    """Start infrastructure, make sure the model exists and every service port is free.
    `path_roots`: more directories the trainer lets runs name paths under; `trainer_ranks`:
    the trainer's `torchrun` processes; `serve`: more models (name -> directory), a rollout
    replica each (a tiny one is built where a directory has no model)."""
    state_dir = settings.state_dir.resolve()
    record = read_stack(state_dir)
    if record is not None:
        if alive(record.supervisor_pid):
            raise StackError(f"a stack is already running from {state_dir} (treadle down stops it)")
        stack_file(state_dir).unlink(missing_ok=True)  # left by a supervisor that died
    rollout_python = settings.rollout_python
    if rollout_python is not None and not os.access(rollout_python, os.X_OK):
        raise StackError(f"TREADLE_ROLLOUT_PYTHON={rollout_python}: not an executable")
    serve = dict(serve or {})
    ports = free_ports(settings, base_port, serve)
    tokens_file = ensure_tokens(settings, state_dir)
    servers = Infra(settings)
    infra = servers.up(("redis", "nats", "s3") if with_s3 else ("redis", "nats"))
    started = [s.name for s in infra if s.detail == "started"]
    if model_dir is None:
        model_dir = state_dir / "models" / "tiny"
    try:
        for path in (model_dir, *serve.values()):
            if not (path / "config.json").exists():
                from treadle_cli.tiny_model import init_tiny

                init_tiny(path)
    except BaseException:  # interrupted or failed: stop what this call started
        servers.down(started)
        raise
    return StackSpec(
        state_dir=str(state_dir),
        cwd=os.getcwd(),
        redis_url=settings.redis_url,
        nats_url=settings.nats_url,
        model_dir=str(model_dir.resolve()),
        model_name=model_name or model_dir.name,
        ports=ports,
        infra_started=started,
        host=settings.host,
        auth_tokens_file=str(tokens_file) if tokens_file else None,
        infra_secrets_file=str(servers.secrets_path),
        secured_infra=[s.name for s in infra if s.managed and s.name in ("redis", "nats")],
        path_roots=[str(Path(p).resolve()) for p in path_roots],
        trainer_ranks=trainer_ranks,
        served={name: str(path.resolve()) for name, path in serve.items()},
        rollout_python=str(rollout_python.absolute()) if rollout_python else None,
    )


def ensure_tokens(settings: CliSettings, state_dir: Path) -> Path | None:
    """The stack's token table: the one the caller configured (TREADLE_AUTH_TOKENS[_FILE]),
    else `{state_dir}/auth/tokens.json`, generated on the first `up` and kept (0600); the
    admin token goes beside it for the CLI (`admin.token`). None: TREADLE_AUTH=off."""
    if settings.auth == "off":
        return None
    path = auth_dir(state_dir) / "tokens.json"
    if settings.auth_tokens is not None:
        auth.write_private(path, settings.auth_tokens.get_secret_value())
    elif settings.auth_tokens_file is not None:
        path = settings.auth_tokens_file  # the caller's: read, never written
    elif not path.exists():
        auth.write_private(path, json.dumps(auth.TokenTable.generate(), indent=2))
    table = auth.TokenTable.parse(path.read_text(), str(path))  # malformed: say so now
    admin = table.token_of(auth.Role.admin)
    if admin is not None:
        auth.write_private(admin_token_file(state_dir), admin)
    return path.resolve()


@contextlib.contextmanager
def owned(
    settings: CliSettings, model_dir: Path | None, model_name: str | None, **prepare_args: Any
) -> Iterator[StackSpec]:
    """A stack of this process's own (a bench's, `treadle run`'s): prepared, launched, and
    stopped on the way out however the block ends (an error, Ctrl-C, or SIGTERM through
    `signals`); should this process die outright, its supervisor stops it (`owner_pid`)."""
    started: list[str] = []
    try:
        spec = prepare(settings, model_dir, model_name, None, **prepare_args)
        started = spec.infra_started
        spec.owner_pid = os.getpid()
        launch_detached(spec)
        yield spec
    finally:
        down(settings)
        Infra(settings).down(started)  # what `down` did not (no supervisor got to record it)


def launch_detached(spec: StackSpec) -> int:
    state_dir = Path(spec.state_dir)
    spec_path = state_dir / "stack-spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    log_path = state_dir / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle_cli.stack", str(spec_path)],
            cwd=spec.cwd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 10
    try:
        while read_stack(state_dir) is None:
            if proc.poll() is not None:
                raise StackError(f"supervisor exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise StackError(f"supervisor did not start; see {log_path}")
            time.sleep(0.1)
    except BaseException:  # interrupted, or it failed: it stops what it started
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        raise
    return proc.pid


def down(settings: CliSettings, timeout_s: float = 60.0) -> list[str]:
    """Stop the supervisor (which stops services and the infra it started); kill leftovers."""
    state_dir = settings.state_dir.resolve()
    record = read_stack(state_dir)
    stopped: list[str] = []
    if record is not None:
        sup = record.supervisor_pid
        if alive(sup):
            os.kill(sup, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while alive(sup) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(sup):
                terminate(sup)
        for name, svc in record.services.items():
            if svc.pid and alive(svc.pid):
                terminate(svc.pid)
            stopped.append(name)
        if record.spec.infra_started:
            stopped += Infra(settings).down()
        stack_file(state_dir).unlink(missing_ok=True)
    return stopped


def main() -> None:
    spec = StackSpec(**json.loads(Path(sys.argv[1]).read_text()))
    Supervisor(spec).run_forever()


if __name__ == "__main__":
    main()
