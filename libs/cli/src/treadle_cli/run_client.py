"""`treadle run`: evaluate, warm up, submit a recipe to the trainer and follow it to the end.

Uses the stack `treadle up` started when one is healthy (its rollout must serve the recipe's
model); otherwise starts one for the recipe's model and stops it afterwards. The phases:

1. greedy evaluation on the held-out tasks (`eval`), through rollout's `POST /v1/evaluate`;
2. the SFT warm-up (`sft`) through the trainer's training API, then evaluation again;
3. the RL run, started from the warm-up's weight-store version, with a live table;
4. the final evaluation, the final weights exported as an HF directory, a plot.

Writes the resolved config, `metrics.jsonl`, `metrics.png`, `summary.json` and
`final-model/` under `{output_dir}/{run_id}/`. Exits non-zero when the run fails, when
exactly-once accounting does not add up, or when `eval.min_improvement` (start -> end) or
`eval.min_rl_improvement` (after the warm-up -> end: RL's own lift) is not met.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import httpx
from pydantic import Field
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from treadle_cli import stack
from treadle_cli.report import EvalRow, EvalSummary, RunReport, SftRow, StepRow
from treadle_cli.settings import CliSettings
from treadle_cli.warmup import TrainingSession, demonstrations, validation_tasks
from treadle_common.api.rollout import EvaluateRequest, EvaluateResult, RolloutInfo
from treadle_common.api.runs import RunState, RunStatus, Usage
from treadle_common.clients.env import EnvClient
from treadle_common.clients.http import ApiError
from treadle_common.clients.rollout import RolloutClient
from treadle_common.clients.trainer import TrainerClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config.recipe import RunConfig, dump_resolved
from treadle_common.model.export import export_hf
from treadle_common.tasks.evaluation import held_out_tasks

T = TypeVar("T")


class RunSummary(EvalSummary):
    """`summary.json`: the run's accounting as the trainer reports it, the weight store's and
    rollout's view of its versions, and the held-out evaluations (`EvalSummary`)."""

    eval: dict[str, float] = Field(default_factory=dict)
    run_id: str
    state: RunState
    error: str | None = None
    steps: int
    tasks_fed: int
    tasks_cancelled: int
    tasks_dead: int = 0
    dead_lettered: dict[str, int] = Field(default_factory=dict)
    trajectories_quarantined: int = 0
    trajectories_discarded: int = 0
    broken_envs: dict[str, str] = Field(default_factory=dict)
    trajectories_produced: int
    trajectories_consumed: int
    trajectories_trained: int
    trajectories_acked: int
    rejected: int
    duplicates: int
    pending_after_run: int | None
    dropped: dict[str, int]
    usage: Usage = Field(default_factory=Usage, description="What the run used of the fleet")
    exactly_once: bool
    versions_published: list[int]
    weight_store_versions: list[int]
    rollout_policy_version: int
    rollout_swaps: int
    mean_reward_per_step: list[float]
    final_model_dir: str | None = None
    plot: str | None = None
    reconnects: int = Field(
        0, description="Times `treadle run` lost a service (restarting, run moved) and got back"
    )


class Unreachable(RuntimeError):
    """A service did not answer for `run_reconnect_s`."""


class Reconnect:
    """Calls to a service that may be restarting or handing its run to another trainer:
    transport errors and 5xx answers (and a 404 where the caller says the object exists)
    are retried with jittered backoff, up to `give_up_s` without an answer."""

    def __init__(self, console: Console, give_up_s: float):
        self.console, self.give_up_s = console, give_up_s
        self.outages = 0

    def call(self, what: str, fn: Callable[[], T], exists: bool = False) -> T:
        since: float | None = None
        delay = 0.5
        while True:
            try:
                result = fn()
            except (httpx.TransportError, ApiError) as exc:
                code = exc.status_code if isinstance(exc, ApiError) else None
                if code is not None and code < 500 and not (exists and code == 404):
                    raise
                now = time.monotonic()
                if since is None:
                    since = now
                    self.outages += 1
                    self.console.print(f"[yellow]{what}: {exc}; reconnecting[/yellow]")
                if now - since > self.give_up_s:
                    raise Unreachable(f"{what}: no answer for {now - since:.0f}s: {exc}") from exc
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 5.0)
                continue
            if since is not None:
                self.console.print(f"{what}: back after {time.monotonic() - since:.1f}s")
            return result


@dataclass(frozen=True)
class Urls:
    """Where the run's HTTP APIs answer (the weight-store's data plane is gRPC)."""

    trainer: str
    rollout: str


class RunClient:
    def __init__(self, config: RunConfig, settings: CliSettings, console: Console):
        self.config = config
        self.settings = settings
        self.console = console
        self.state_dir = settings.state_dir.resolve()
        self.reconnect = Reconnect(console, settings.run_reconnect_s)

    def execute(self, health_timeout_s: float) -> int:
        cfg = self.config
        cfg.model.path = cfg.model.path.resolve()
        if cfg.model.init_tiny and not (cfg.model.path / "config.json").exists():
            from treadle_cli.tiny_model import init_for

            init_for(cfg.model.path, cfg.model, cfg.trainer.seed)
        current = None if self.remote else stack.status(self.state_dir)
        with contextlib.ExitStack() as own:  # a stack this run starts is stopped with it
            if current is not None and not current.healthy:
                if current.running:
                    self.console.print(
                        "[red]a stack is running but unhealthy[/red]; treadle status says why"
                    )
                    return 1
                # the stack is this run's: its trainer may use the recipe's paths
                mine = [cfg.model.path, cfg.output_dir]
                if cfg.data.path is not None:
                    mine.append(cfg.data.path.parent)
                t = cfg.trainer
                ranks = t.tensor_parallel * t.pipeline_parallel if t.backend == "megatron" else 1
                own.enter_context(
                    stack.owned(
                        self.settings,
                        cfg.model.path,
                        cfg.model.name,
                        path_roots=mine,
                        trainer_ranks=ranks,
                    )
                )
                current = stack.wait_healthy(self.state_dir, health_timeout_s)
                if not current.healthy:
                    self.console.print(
                        f"[red]stack not healthy after {health_timeout_s:.0f}s[/red]: "
                        + current.model_dump_json()[:2000]
                    )
                    for name, service in current.services.items():
                        if not service.healthy:  # which one, and why
                            why = service.last_error or "no error logged"
                            self.console.print(f"[red]{name}[/red]: {escape(why)}")
                    return 1
            return self._follow()

    def _spec(self) -> stack.StackSpec:
        record = stack.read_stack(self.state_dir)
        if record is None:
            raise RuntimeError(f"no stack recorded in {self.state_dir}")
        return record.spec

    @property
    def remote(self) -> bool:
        """A deployed stack (compose, Kubernetes) named by TREADLE_*_URL settings."""
        return self.settings.trainer_url is not None

    def _urls(self) -> Urls:
        s = self.settings
        if self.remote:
            if not (s.rollout_url and s.weight_store_url):
                raise RuntimeError(
                    "TREADLE_TRAINER_URL needs TREADLE_ROLLOUT_URL and _WEIGHT_STORE_URL"
                )
            assert s.trainer_url is not None
            return Urls(trainer=s.trainer_url, rollout=s.rollout_url)
        spec = self._spec()
        rollout = spec.rollout_urls().get(self.config.model.name, spec.http_url("rollout"))
        return Urls(trainer=spec.http_url("trainer"), rollout=rollout)

    def _grpc(self, service: str) -> str:
        if self.remote:
            return {
                "env-gateway": self.settings.env_gateway_addr,
                "weight-store": self.settings.weight_store_addr,
            }[service]
        spec = self._spec()
        return spec.grpc_addr(service)

    def _follow(self) -> int:
        cfg = self.config
        urls = self._urls()
        http = stack.http(self.settings.client_token())
        self.trainer = TrainerClient(urls.trainer, http)
        self.rollout = RolloutClient(urls.rollout, http)
        info = self.reconnect.call("rollout", self.rollout.info)
        if info.model != cfg.model.name or Path(info.model_dir) != cfg.model.path:
            self.console.print(
                f"[red]rollout serves {info.model} from {info.model_dir}[/red]; "
                f"the recipe needs {cfg.model.name} from {cfg.model.path} (treadle down, then run)"
            )
            return 1
        out_dir = cfg.output_dir / cfg.run_id
        report = RunReport(out_dir)
        dump_resolved(cfg, out_dir / "config.yaml")
        held_out = asyncio.run(self._prepare(report))
        dump_resolved(cfg, out_dir / "config.yaml")  # with the warm-up's init_version
        try:
            run = self._start_run()
        except ApiError as exc:
            self.console.print(f"[red]trainer refused the run ({exc.status_code})[/red]: {exc}")
            return 1
        run, lost_contact = self._watch(run, report, held_out)
        return self._conclude(run, report, held_out, lost_contact)

    def _watch(
        self, run: RunStatus, report: RunReport, held_out: list[dict]
    ) -> tuple[RunStatus, str | None]:
        """Follow the run to its end, its steps into `report`, evaluating every
        `eval.every` steps: the run as it ended, and why contact was lost (None: it was not).
        """
        cfg = self.config
        steps = run.steps
        evaluated = 0
        with Live(run_table(cfg, run, report), console=self.console, refresh_per_second=2) as live:
            while not run.finished:
                time.sleep(0.5)
                # only the records not seen yet: a long run's answer stays small. Any trainer
                # answers for the run, its owner or not: the client rides through restarts.
                try:
                    run = self.reconnect.call(
                        "trainer",
                        functools.partial(self.trainer.get_run, cfg.run_id, len(steps)),
                        exists=True,
                    )
                except Unreachable as exc:
                    run.steps = steps
                    return run, str(exc)
                for record in run.steps:
                    report.add(StepRow(**record.model_dump()), at=record.finished_at or None)
                steps += run.steps
                run.steps = steps
                if held_out and not run.finished and run.steps:
                    evaluated = self._maybe_evaluate(run.steps[-1], evaluated, held_out, report)
                live.update(run_table(cfg, run, report))
        return run, None

    def _maybe_evaluate(self, step, evaluated: int, held_out: list[dict], report) -> int:
        """Evaluate at a step that `eval.every` names (not the last: the end's covers it);
        the last step evaluated."""
        every = self.config.eval.every
        last_step = step.step >= self.config.trainer.num_steps
        if not every or step.step % every != 0 or step.step == evaluated or last_step:
            return evaluated
        result = None
        try:
            result = self._evaluate(held_out, f"step {step.step}", step.version, report, own=True)
        finally:  # a sync run waits there until told; its trackers record the result
            self._evaluation_done(step.step, result)
        return step.step

    def _conclude(
        self, run: RunStatus, report: RunReport, held_out: list[dict], lost_contact: str | None
    ) -> int:
        """The end evaluation, the final model's export, the summary: the exit status."""
        out_dir = self.config.output_dir / self.config.run_id
        summary = self._summary(run)
        if lost_contact is not None:
            summary.error = f"treadle run lost contact with the trainer: {lost_contact}"
        last = summary.rollout_policy_version
        ended = False
        try:
            if held_out and lost_contact is None:
                self._evaluate(held_out, "end", last, report, own=True)
                summary = summary.model_copy(update=report.eval_summary().model_dump())
            if run.state == "succeeded":
                summary.final_model_dir = str(asyncio.run(self._export(last, out_dir)))
            ended = True
        except Exception as exc:  # the summary is written whatever failed
            summary.error = f"after the run: {type(exc).__name__}: {exc}"
        if report.steps():
            summary.plot = str(report.plot())
        summary.reconnects = self.reconnect.outages
        (out_dir / "summary.json").write_text(summary.model_dump_json(indent=2))
        self.console.print_json(summary.model_dump_json())
        ok = ended and run.state == "succeeded" and run.exactly_once and self._improved(report)
        self.console.print(
            ("[green]run succeeded[/green]" if ok else "[red]run failed[/red]")
            + f" — outputs in {out_dir}"
        )
        return 0 if ok else 1

    def _start_run(self) -> RunStatus:
        """Submit the run, retrying while the trainer is away; a 409 after a retry means
        the first attempt got through: follow that run."""
        cfg, retried = self.config, False

        def start() -> RunStatus:
            nonlocal retried
            try:
                return self.trainer.start_run(cfg)
            except httpx.TransportError:
                retried = True
                raise
            except ApiError as exc:
                if exc.status_code == 409 and retried:
                    return self.trainer.get_run(cfg.run_id)
                retried = retried or exc.status_code >= 500
                raise

        return self.reconnect.call("trainer", start)

    def _evaluation_done(self, step: int, result: EvaluateResult | None) -> None:
        """Tell the run `step` was evaluated, and what it scored (a sync run holds there; the
        run's trackers record it); a run that moved to another trainer holds nowhere."""
        reward = None if result is None else result.mean_reward
        num_tasks = 0 if result is None else result.num_tasks
        try:
            self.reconnect.call(
                "trainer",
                lambda: self.trainer.evaluation_done(self.config.run_id, step, reward, num_tasks),
            )
        except ApiError as exc:
            if exc.status_code != 409:
                raise

    async def _prepare(self, report: RunReport) -> list[dict]:
        """Held-out tasks, the start evaluation and the SFT warm-up (then evaluation again).

        The recipe's model is published first, so the start evaluation scores the policy
        the run begins from, whatever versions the weight store already holds; a recipe that
        names `model.init_version` starts from that stored version instead, with neither a
        warm-up nor a start evaluation (the run publishes it as its base version).
        """
        cfg = self.config
        if cfg.model.init_version is not None and cfg.sft.steps:
            raise ValueError("the SFT warm-up starts from model.path: drop model.init_version")
        env = EnvClient(self._grpc("env-gateway"), token=self.settings.client_token())
        try:
            held_out = await held_out_tasks(env, cfg)
            data = await demonstrations(env, cfg, held_out) if cfg.sft.steps else []
            checks = await validation_tasks(env, cfg, held_out) if cfg.sft.target_reward else []
        finally:
            await env.close()
        if not held_out and not data:
            return held_out
        if cfg.model.init_version is not None:  # rollout holds it only once the run starts
            return held_out
        token = self.settings.client_token()
        async with TrainingSession(self.trainer.base_url, cfg, token) as session:
            cfg.model.init_version = await session.save_weights()
            if held_out:
                self._evaluate(held_out, "start", cfg.model.init_version, report)
            if not data:
                return held_out
            with self.console.status("SFT warm-up") as status:

                def on_step(row: SftRow) -> None:
                    report.add(row)
                    status.update(
                        f"SFT warm-up: step {row.sft_step}/{cfg.sft.steps}, loss {row.loss:.4f}"
                    )

                async def validate(step: int, version: int) -> float:
                    status.update(f"SFT warm-up: step {step}, validating")
                    result = self._evaluate(checks, f"sft step {step}", version, report, "sft_val")
                    return result.mean_reward

                warm = await session.sft(data, on_step, validate if checks else None)
        self.console.print(
            f"SFT warm-up: {warm.steps} steps on {warm.examples} demonstrations in "
            f"{warm.seconds:.0f}s, loss {warm.first_loss:.3f} -> {warm.last_loss:.3f}, "
            f"version {warm.version}"
        )
        cfg.model.init_version = warm.version
        await self._pin(warm.version)
        if held_out:
            self._evaluate(held_out, "after_sft", warm.version, report)
        return held_out

    async def _pin(self, version: int) -> None:
        """Keep the warm-up's version past the store's retention: the run's config.yaml names
        it as `model.init_version`, so another run can start from the same weights."""
        store = WeightStoreClient(self._grpc("weight-store"), token=self.settings.client_token())
        try:
            await store.set_pin(self.config.model.name, version)
        finally:
            await store.close()

    def _evaluate(
        self,
        tasks: list[dict],
        phase: str,
        version: int,
        report: RunReport,
        kind: Literal["eval", "sft_val"] = "eval",
        own: bool = False,
    ) -> EvaluateResult:
        """Greedy episodes on `tasks` with `version`, scored by the eval scorer; recorded as
        `kind` (`eval` on the held-out set, `sft_val` on the warm-up's validation set).
        `own`: a version the run published (of its own policy model: a LoRA run's adapter,
        which rollout loads for the evaluation), else one of the model itself."""
        cfg, options = self.config, self.config.eval.scorer_options
        adapter = own and cfg.policy_model != cfg.model.name
        if not adapter:
            self._wait_rollout_version(version)
        request = EvaluateRequest(
            model=cfg.policy_model if adapter else None,
            min_version=max(0, version) if adapter else 0,
            env=cfg.env.name,
            env_options=cfg.env.options,
            tasks=tasks,
            scorer=cfg.eval.scorer or cfg.scorer,
            scorer_options=cfg.scorer_options if options is None else options,
            max_turns=cfg.rollout.max_turns,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens,
        )
        result = self.reconnect.call("rollout", lambda: self.rollout.evaluate(request))
        report.add(
            EvalRow(
                kind=kind,
                phase=phase,
                **result.model_dump(include={"mean_reward", "num_tasks", "policy_versions"}),
                statuses=result.statuses,
                seconds=round(result.seconds, 2),
            )
        )
        which = "held-out" if kind == "eval" else "validation"
        self.console.print(
            f"eval ({phase}): mean reward {result.mean_reward:.3f} on "
            f"{result.num_tasks} {which} tasks, policy version {result.policy_versions}"
        )
        return result

    async def _export(self, version: int, out_dir: Path) -> Path:
        client = WeightStoreClient(self._grpc("weight-store"), token=self.settings.client_token())
        try:
            return await export_hf(
                client, self.config.policy_model, version, out_dir / "final-model"
            )
        finally:
            await client.close()

    def _improved(self, report: RunReport) -> bool:
        """The eval gates: start -> end (`min_improvement`) and after the warm-up -> end
        (`min_rl_improvement`, what RL alone gained); one line says both."""
        e = report.eval_summary()
        if e.eval_end is None:
            return True
        ok = True
        parts = ["eval reward"]
        if e.eval_start is not None:
            parts.append(f"{e.eval_start:.3f} at the start ->")
        if e.eval_after_sft is not None:
            parts.append(f"{e.eval_after_sft:.3f} after the warm-up ->")
        parts.append(f"{e.eval_end:.3f} at the end")
        gates = [
            ("eval.min_improvement", "gain", e.gain, self.config.eval.min_improvement),
            ("eval.min_rl_improvement", "rl lift", e.rl_lift, self.config.eval.min_rl_improvement),
        ]
        for name, what, got, want in gates:
            if got is None:  # no evaluation to measure it by: a gate on it cannot pass
                ok = ok and want is None
                if want is not None:
                    parts.append(f"; {name} {want}: NOT met (no {what})")
                continue
            met = want is None or got >= want
            ok = ok and met
            verdict = "" if want is None else f" ({name} {want}: {'met' if met else 'NOT met'})"
            parts.append(f"; {what} {got:+.3f}{verdict}")
        line = " ".join(parts).replace(" ;", ";")
        self.console.print(line, style=None if ok else "red", soft_wrap=True)
        return ok

    def _summary(self, run: RunStatus) -> RunSummary:
        last = run.last_version
        try:
            rollout: RolloutInfo | None = self._wait_rollout_version(last or 0)
        except Unreachable as exc:
            self.console.print(f"[red]{exc}[/red]")
            rollout = None
        try:
            stored = asyncio.run(self._stored_versions())
        except Exception as exc:  # the store is away: the summary says so
            self.console.print(f"[red]weight-store: {exc!r}[/red]")
            stored = []
        return summarize(run, rollout, stored, self.config.policy_model)

    async def _stored_versions(self) -> list[int]:
        store = WeightStoreClient(self._grpc("weight-store"), token=self.settings.client_token())
        try:
            return [v.version for v in await store.list_versions(self.config.policy_model)]
        finally:
            await store.close()

    def _wait_rollout_version(self, version: int, timeout_s: float = 30.0) -> RolloutInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.reconnect.call("rollout", self.rollout.info)
            if info.policy_version >= version or time.monotonic() > deadline:
                return info
            time.sleep(0.2)


def run_table(config: RunConfig, run: RunStatus, report: RunReport) -> Table:
    """The live view of a run: its last steps and its evaluations."""
    evals = ", ".join(f"{e.phase} {e.mean_reward:.3f}" for e in report.evals())
    steps = run.steps
    table = Table(
        title=f"run {run.run_id} ({config.mode}) — {run.state}, "
        f"step {run.step}/{config.trainer.num_steps}",
        caption=f"eval: {evals}" if evals else None,
    )
    columns = ("step", "version", "reward", "trajectories", "loss", "tokens/s", "staleness")
    for column in (*columns, "publish MB", "wait s", "s"):
        table.add_column(column)
    for s in steps[-12:]:
        table.add_row(
            str(s.step),
            str(s.version),
            f"{s.mean_reward:.3f}",
            str(s.num_trajectories),
            f"{s.loss:.4f}",
            f"{s.tokens_per_s:.0f}",
            str(s.max_staleness),
            f"{s.bytes_published / 2**20:.2f}",
            f"{s.wait_for_batch_s:.1f}",
            f"{s.duration_s:.1f}",
        )
    return table


def summarize(
    run: RunStatus, rollout: RolloutInfo | None, stored: list[int], policy_model: str
) -> RunSummary:
    """A run's summary: its counters, the versions it published and those the store and
    rollout hold (rollout None: it did not answer)."""
    counters = run.model_dump(
        include={
            "run_id",
            "state",
            "error",
            "tasks_fed",
            "tasks_cancelled",
            "tasks_dead",
            "dead_lettered",
            "trajectories_quarantined",
            "trajectories_discarded",
            "broken_envs",
            "trajectories_produced",
            "trajectories_consumed",
            "trajectories_trained",
            "trajectories_acked",
            "rejected",
            "duplicates",
            "pending_after_run",
            "dropped",
            "usage",
        }
    )
    return RunSummary(
        **counters,
        steps=run.step,
        exactly_once=run.exactly_once,
        versions_published=run.versions,
        weight_store_versions=stored,
        rollout_policy_version=rollout.version_of(policy_model) if rollout else -1,
        rollout_swaps=rollout.swaps if rollout else 0,
        mean_reward_per_step=[round(s.mean_reward, 4) for s in run.steps],
    )
