"""`treadle bench chaos`: an async run survives the death of every service and the restart of
its infrastructure, losing and doubling nothing.

On a private stack (`treadle up`'s supervisor, own redis-server with AOF and nats-server with
JetStream on disk, free ports) the recipe (`recipes/chaos.yaml`) runs through `treadle run`
itself (`RunClient`), with two rollout replicas (the supervised one and `rollout-second`),
once without faults (the baseline) and once while a second thread,
waiting for the run to make progress between faults, does, in order:

1. SIGKILL rollout mid-episode, 2. reward mid-score, 3. env-gateway with live sessions,
4. weight-store right after a step (its publish in flight), 5. the trainer mid-step (each
   restarted by the supervisor),
6. restarts redis-server (SIGTERM, AOF), 7. restarts nats-server (SIGTERM, JetStream on disk),
8. SIGKILLs a second rollout replica (started with the run, not supervised) while it holds
   tasks: the first reclaims them once they stop being heartbeated,
9. starts a second trainer, which must refuse the run (409) while it is owned, then
10. SIGTERMs the owner: it hands the run off at its step boundary and the second resumes it.

Then the run's ledger in Redis is read: every trajectory rollout produced (counted atomically
with its XADD) must have been trained exactly once or dropped with a reason.

- `faults_injected`, `faults`: what was done, at which step, how long until the run's next step;
- `completed`: the run succeeded and `treadle run` exited 0;
- `produced`, `trained`, `dropped` (by reason), `lost` (produced, neither trained nor dropped),
  `trained_twice`, `trained_and_dropped`; `dead_lettered` tasks by reason;
- `wall_s` / `baseline_wall_s` = `slowdown` (the whole `treadle run`, start to summary);
- `restarts` per service (supervisor), `resumed` (times the run was restored), `reconnects`
  (times `treadle run` lost the trainer or rollout and got back).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from treadle_bench.harness import private_stack
from treadle_cli import stack
from treadle_cli.infra import Infra, free_port_range, terminate
from treadle_cli.run_client import RunClient
from treadle_cli.settings import CliSettings
from treadle_cli.tiny_model import init_for
from treadle_common import names
from treadle_common.api.runs import RunStatus
from treadle_common.config.recipe import RunConfig, load_recipe

GAP_STEPS = 2
"""Steps the run must make between two faults (so each fault hits a run that recovered)."""


@dataclass
class Fault:
    name: str
    at_step: int
    at_s: float
    detail: str = ""
    recovered_s: float | None = None
    """Seconds from the fault to the run's next step."""


class ChaosMonkey:
    """Injects the faults into a running run, one after another, on the run's progress."""

    def __init__(
        self,
        spec: stack.StackSpec,
        settings: CliSettings,
        run_id: str,
        replica: tuple[subprocess.Popen, str],
    ):
        self.spec, self.settings, self.run_id = spec, settings, run_id
        self.state_dir = Path(spec.state_dir)
        self.r: Any = redis.Redis.from_url(spec.client_url("redis"), socket_timeout=2)
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.second: subprocess.Popen | None = None
        self.replica = replica  # the second rollout replica, killed by one fault
        self.extras: list[subprocess.Popen] = []
        self.stop = threading.Event()
        self.started = time.monotonic()
        self._step = 0

    # -- watching the run ------------------------------------------------------------------
    def step(self) -> int:
        """The run's step as its owner last wrote it (the last value if Redis is away)."""
        try:
            raw = self.r.get(names.run_status(self.run_id))
            if raw is not None:
                self._step = RunStatus.model_validate_json(raw).step
        except redis.RedisError:
            pass
        return self._step

    def finished(self) -> bool:
        try:
            raw = self.r.get(names.run_status(self.run_id))
        except redis.RedisError:
            return False
        return raw is not None and RunStatus.model_validate_json(raw).finished

    def _wait(self, until: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not until():
            if self.stop.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _healthy(self) -> bool:
        return stack.status(self.state_dir).healthy

    def _busy(self, service: str, stage: str) -> Callable[[], bool]:
        """True while `service` has work in `stage` (an episode, a score, a step...)."""
        url = self.spec.http_url(service)

        def busy() -> bool:
            info = stack.service_info(url, token=stack.token_for(self.state_dir))
            progress = info.progress.get(stage) if info is not None else None
            return progress is not None and progress.pending > 0

        return busy

    # -- faults ------------------------------------------------------------------------------
    def _kill(self, service: str, sig: signal.Signals = signal.SIGKILL) -> str:
        record = stack.read_stack(self.state_dir)
        pid = record.services[service].pid if record else None
        if pid is None:
            raise RuntimeError(f"{service} has no pid")
        os.killpg(pid, sig)
        return f"{sig.name} pid {pid}"

    def _mid(self, service: str, stage: str, fallback: str = "generate") -> Callable[[], str]:
        """Kill `service` while its `stage` has work; a stage too quick to be caught busy
        (exact-match scoring takes microseconds) falls back to: while rollout's episodes
        run (their scoring requests then find it dead)."""

        def fault() -> str:
            if self._wait(self._busy(service, stage), 10.0):
                return self._kill(service) + f" ({stage} in progress)"
            busy = self._wait(self._busy("rollout", fallback), 10.0)
            where = "rollout episodes in flight" if busy else "idle"
            return self._kill(service) + f" ({stage} not caught busy; {where})"

        return fault

    def _after_step(self, service: str) -> Callable[[], str]:
        def fault() -> str:
            now = self.step()
            self._wait(lambda: self.step() > now, 30.0)
            return self._kill(service)

        return fault

    def _restart_infra(self, name: str) -> Callable[[], str]:
        def fault() -> str:
            infra = Infra(self.settings)
            record = infra._read_pidfile(name)
            if record is None:
                raise RuntimeError(f"{name} was not started by this stack")
            started = time.monotonic()
            terminate(record.pid, timeout_s=20.0)
            infra.up((name,))
            return f"SIGTERM pid {record.pid}, back in {time.monotonic() - started:.1f}s"

        return fault

    def _extra(self, service: str, instance: str) -> tuple[subprocess.Popen, str]:
        proc, url = start_extra(self.spec, service, instance)
        self.extras.append(proc)
        return proc, url

    def _pending_of(self, consumer: str) -> int:
        try:
            summary: Any = self.r.xpending(names.tasks_stream(self.run_id), names.ROLLOUT_GROUP)
        except redis.RedisError:
            return -1
        for entry in summary.get("consumers") or []:
            if entry["name"].decode() == consumer:
                return int(entry["pending"])
        return 0

    def _replica_reclaimed(self) -> str:
        """SIGKILL the second rollout replica while it plays tasks: nobody restarts it, so
        the first replica must reclaim them (after `TREADLE_ROLLOUT_RECLAIM_IDLE_MS`)."""
        proc, url = self.replica
        if not self._wait(lambda: stack.service_health(url).ready, 120.0):
            raise RuntimeError("the second rollout replica did not get ready")
        busy = self._wait(lambda: self._pending_of("rollout-second") > 0, 60.0)
        held = self._pending_of("rollout-second")
        os.killpg(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        reclaimed = self._wait(lambda: self._pending_of("rollout-second") == 0, 120.0)
        took = time.monotonic() - killed
        return (
            f"SIGKILL pid {proc.pid} holding {held} task(s)"
            + ("" if busy else " (caught idle)")
            + (
                f"; reclaimed by the other replica in {took:.1f}s"
                if reclaimed
                else "; NOT reclaimed"
            )
        )

    def _second_trainer(self) -> str:
        self.second, url = self._extra("trainer", "trainer-second")
        if not self._wait(lambda: stack.service_health(url).ready, 120.0):
            raise RuntimeError("the second trainer did not get ready")
        config = self.r.get(names.run_config(self.run_id))
        assert config is not None
        body = json.loads(config)
        http = stack.http(stack.token_for(self.state_dir))
        answer = http.post(f"{url}/v1/runs", json=body, timeout=10)
        if answer.status_code != 409:
            raise RuntimeError(f"the second trainer took the owned run: {answer.status_code}")
        return f"pid {self.second.pid}; POST /v1/runs for the run: 409"

    def _hand_off(self) -> str:
        detail = self._kill("trainer", signal.SIGTERM)
        ok = self._wait(lambda: self._owner().startswith("trainer-second#"), 120.0)
        return detail + ("; the second trainer owns the run" if ok else "; NOT taken over")

    def _owner(self) -> str:
        try:
            raw = self.r.get(names.run_owner(self.run_id))
        except redis.RedisError:
            return ""
        return raw.decode() if raw else ""

    def plan(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("rollout_sigkill_mid_episode", self._mid("rollout", "generate")),
            ("reward_sigkill_mid_score", self._mid("reward", "score")),
            ("env_gateway_sigkill_live_sessions", self._mid("env-gateway", "step")),
            ("weight_store_sigkill_mid_publish", self._after_step("weight-store")),
            ("trainer_sigkill_mid_step", self._mid("trainer", "step")),
            ("redis_restart", self._restart_infra("redis")),
            ("nats_restart", self._restart_infra("nats")),
            ("rollout_replica_sigkill_reclaimed", self._replica_reclaimed),
            ("second_trainer_started", self._second_trainer),
            ("trainer_sigterm_hand_off", self._hand_off),
        ]

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported in the result, never silent
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        last = 0
        for name, fault in self.plan():
            ready = self._wait(lambda: self.step() >= last + GAP_STEPS, 600.0)  # noqa: B023
            if not ready or self.finished():
                self.errors.append(f"{name}: the run ended or stopped before it")
                return
            self._wait(self._healthy, 120.0)
            at_step, at = self.step(), time.monotonic()
            detail = fault()
            record = Fault(name, at_step, round(at - self.started, 2), detail)
            self.faults.append(record)
            step = self.step()
            if self._wait(lambda: self.step() > step, 600.0):  # noqa: B023
                record.recovered_s = round(time.monotonic() - at, 2)
            last = self.step()

    def close(self) -> None:
        self.stop.set()
        for proc in self.extras:
            if proc.poll() is None:
                terminate(proc.pid, timeout_s=30.0)


def start_extra(spec: stack.StackSpec, service: str, instance: str) -> tuple[subprocess.Popen, str]:
    """Another replica of `service` beside the supervised one (its own HTTP port; nobody
    restarts it)."""
    env = spec.env(service)
    http_port = free_port_range(1)
    env |= {"TREADLE_INSTANCE": instance, "TREADLE_HTTP_PORT": str(http_port)}
    log = Path(spec.state_dir) / "logs" / f"{instance}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", names.module_of(service)],
            env=env,
            cwd=spec.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"http://{spec.host}:{http_port}"


def ledger_check(r: Any, run_id: str) -> dict[str, Any]:
    """Every produced trajectory trained exactly once or dropped with a reason, from the
    run's ledger (a `rollback` entry undoes the training of the ids it drops)."""
    state = {k.decode(): v.decode() for k, v in r.hgetall(names.run_state(run_id)).items()}
    produced = int(state.get("trajectories_produced", 0))
    trained: Counter[str] = Counter()
    dropped: dict[str, str] = {}
    for _, fields in r.xrange(names.ledger_stream(run_id)):
        drops = json.loads(fields[b"dropped"])
        if fields[b"kind"] == b"rollback":
            for tid in drops:
                trained[tid] -= 1
        trained.update(json.loads(fields[b"trained"]))
        dropped.update(drops)
    once = {t for t, n in trained.items() if n == 1}
    handled = once | set(dropped)
    dead = Counter(f[b"reason"].decode() for _, f in r.xrange(names.dead_letters(run_id)))
    return {
        "produced": produced,
        "trained": len(once),
        "dropped": dict(Counter(dropped.values())),
        "lost": max(0, produced - len(handled)),
        "accounted_beyond_produced": max(0, len(handled) - produced),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "trained_and_dropped": len(once & set(dropped)),
        "dead_lettered": dict(dead),
        "unexplained_drops": sum(1 for reason in dropped.values() if not reason),
    }


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _tracebacks(logs: Path) -> dict[str, int]:
    out = {}
    for log in sorted(logs.glob("*.log")):
        count = log.read_text(errors="replace").count("Traceback (most recent call last)")
        if count:
            out[log.stem] = count
    return out


def run(
    steps: int | None = None,
    recipe: Path = Path("recipes/chaos.yaml"),
    overrides: list[str] | None = None,
    baseline: bool = True,
) -> dict[str, Any]:
    saved = dict(os.environ)  # the stack's services inherit these; the caller gets its own back
    os.environ.setdefault("TREADLE_LOG_LEVEL", "WARNING")
    # a replica that dies is not heartbeating its tasks: another takes them after this
    os.environ.setdefault("TREADLE_ROLLOUT_RECLAIM_IDLE_MS", "10000")
    try:
        return _run(steps, recipe, overrides, baseline)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _config(recipe: Path, tmp: Path, run_id: str, steps: int | None, overrides) -> RunConfig:
    extra = [f"trainer.num_steps={steps}"] if steps else []
    return load_recipe(
        recipe,
        [
            f"run_id={run_id}",
            f"model.path={tmp / 'models' / 'tiny'}",
            f"output_dir={tmp / 'runs'}",
            *(overrides or []),
            *extra,
        ],
    )


def _baseline(config: RunConfig, settings: CliSettings, console: Console) -> float:
    """The same run without faults: its wall time."""
    started = time.perf_counter()
    code = RunClient(config, settings, console).execute(180)
    if code != 0:
        raise RuntimeError(f"the baseline run failed; outputs in {config.output_dir}")
    return time.perf_counter() - started


def _second_replica(spec: stack.StackSpec, settings: CliSettings) -> tuple[subprocess.Popen, str]:
    """Two rollout replicas in both runs; one fault kills this one (it is not restarted)."""
    if not stack.wait_healthy(settings.state_dir.resolve(), 180).healthy:
        raise RuntimeError(f"chaos stack not healthy; logs in {settings.state_dir}")
    replica = start_extra(spec, "rollout", "rollout-second")
    if not _until(lambda: stack.service_health(replica[1]).ready, 180.0):
        raise RuntimeError("the second rollout replica did not get ready")
    return replica


def _run(
    steps: int | None, recipe: Path, overrides: list[str] | None, baseline: bool
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-chaos-"))
    console = Console(file=sys.stderr)
    settings = private_stack(tmp)
    model_dir = tmp / "models" / "tiny"
    cfg = _config(recipe, tmp, "chaos", steps, overrides)
    init_for(model_dir, cfg.model, cfg.trainer.seed)
    monkey = replica = None
    with stack.owned(settings, model_dir.resolve(), cfg.model.name, path_roots=[tmp]) as spec:
        try:
            replica = _second_replica(spec, settings)
            baseline_s = None
            if baseline:
                base = _config(recipe, tmp, "chaos-baseline", steps, overrides)
                baseline_s = _baseline(base, settings, console)
            monkey = ChaosMonkey(spec, settings, cfg.run_id, replica)
            injector = threading.Thread(target=monkey.run, name="chaos", daemon=True)
            started = time.perf_counter()
            injector.start()
            code = RunClient(cfg, settings, console).execute(180)
            wall_s = time.perf_counter() - started
            monkey.stop.set()
            injector.join(timeout=60)
            summary = json.loads((tmp / "runs" / cfg.run_id / "summary.json").read_text())
            ledger = ledger_check(monkey.r, cfg.run_id)
            final = RunStatus.model_validate_json(
                monkey.r.get(names.run_status(cfg.run_id)) or "{}"
            )
            record = stack.read_stack(settings.state_dir.resolve())
        finally:
            if monkey is not None:
                monkey.close()
            if replica is not None and replica[0].poll() is None:
                terminate(replica[0].pid, timeout_s=30.0)
    restarts = {n: s.restarts for n, s in record.services.items()} if record else {}
    return {
        "recipe": recipe.name,
        "steps": cfg.trainer.num_steps,
        "faults_injected": len(monkey.faults),
        "faults": [asdict(f) for f in monkey.faults],
        "fault_errors": monkey.errors,
        "completed": code == 0 and summary["state"] == "succeeded",
        "state": summary["state"],
        "exit_code": code,
        "exactly_once": summary["exactly_once"],
        **ledger,
        "resumed": final.resumed,
        "reconnects": summary.get("reconnects", 0),
        "restarts": restarts,
        "wall_s": round(wall_s, 2),
        "baseline_wall_s": round(baseline_s, 2) if baseline_s else None,
        "slowdown": round(wall_s / baseline_s, 3) if baseline_s else None,
        "tracebacks_in_logs": _tracebacks(settings.state_dir / "logs"),
        "outputs": str(tmp),
    }
