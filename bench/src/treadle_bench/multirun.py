"""`treadle bench multirun`: many LoRA runs on one stack at once, against the same runs one
after another on the same stack.

One private stack (own Redis, NATS and ports) serves every phase. If the recipe has an SFT
warm-up it runs once, through the trainer's training API, and every run starts from its
version (`model.init_version`) as LoRA adapters on that one base; each seed's held-out
accuracy after the warm-up is the baseline its `rl_lift` is measured from. Every run is a
real `treadle run` process against the stack.

    alone     run i (seed i) by itself, one after another: the baseline wall time, s/step
              and lift of each seed, and the services' peak RSS with one run
    together  the same runs at once (equal weights): `aggregate_speedup` (sum of alone
              walls / together wall), `rl_lift` per run, `jain_fairness` of their step rates
              while all run, and the services' peak RSS (`memory_ratio` = / alone's)
    weighted  runs at once with weights 2:1:1:...: `share_error`, the largest relative
              error of each run's share of the step rate against its share of the weights
    priority  run 0 with priority 10 beside the others: `priority_slowdown` = its s/step
              there / its s/step in `alone`

`lost` (trajectories produced and never consumed, or left pending) and `trained_twice`
(trajectory ids that two committed steps trained, from each run's ledger) cover every run.
Interrupted (Ctrl-C, SIGTERM), it stops every run it started and its stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from treadle_bench.harness import private_stack
from treadle_cli import stack
from treadle_cli.settings import CliSettings
from treadle_cli.tiny_model import init_for
from treadle_cli.warmup import TrainingSession, demonstrations, validation_tasks
from treadle_common import names
from treadle_common.api.rollout import EvaluateRequest
from treadle_common.api.runs import RunStatus
from treadle_common.clients.env import EnvClient
from treadle_common.clients.rollout import RolloutClient
from treadle_common.clients.trainer import TrainerClient
from treadle_common.config.recipe import RunConfig, load_recipe
from treadle_common.tasks.evaluation import held_out_tasks

DEMO_RECIPE = Path(__file__).resolve().parents[4] / "recipes" / "demo.yaml"


@dataclass
class RunSpec:
    run_id: str
    seed: int
    weight: float = 1.0
    priority: int = 0
    steps: int | None = None


@dataclass
class RunResult:
    spec: RunSpec
    exit_code: int
    wall_s: float
    status: RunStatus
    summary: dict[str, Any]
    trained_twice: int

    @property
    def s_per_step(self) -> float:
        steps = self.status.steps
        return sum(s.duration_s for s in steps) / max(1, len(steps))

    def finished_at(self) -> list[float]:
        return [s.finished_at for s in self.status.steps if s.finished_at]


@dataclass
class Phase:
    results: list[RunResult] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)


def jain(rates: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    return sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates)) if any(rates) else 0.0


def share_error(rates: list[float], weights: list[float]) -> float:
    """The largest relative error of each rate's share against its weight's share."""
    total_r, total_w = sum(rates), sum(weights)
    pairs = zip(rates, weights, strict=True)
    return max(abs(r / total_r - w / total_w) / (w / total_w) for r, w in pairs)


def window_rates(results: list[RunResult]) -> list[float]:
    """Each run's steps per second while all of them were running: from the latest first
    step's start to the earliest last step's end."""
    starts = [r.status.steps[0].finished_at - r.status.steps[0].duration_s for r in results]
    t0, t1 = max(starts), min(r.finished_at()[-1] for r in results)
    if t1 <= t0:
        raise RuntimeError("the runs never all ran at once")
    return [sum(t0 < t <= t1 for t in r.finished_at()) / (t1 - t0) for r in results]


class RssSampler:
    """The peak summed RSS of the stack's service processes and their children, and the CPU
    seconds each service (with its children) spent meanwhile (where a phase's cores go)."""

    def __init__(self, state_dir: Path):
        self.state_dir, self.peak = state_dir, 0
        self.cpu_s: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._cpu0 = self._cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        cpu1 = self._cpu()
        self.cpu_s = {k: round(v - self._cpu0.get(k, 0.0), 1) for k, v in cpu1.items()}

    def _cpu(self) -> dict[str, float]:
        record = stack.read_stack(self.state_dir)
        out: dict[str, float] = {}
        for name, svc in record.services.items() if record else ():
            try:
                proc = psutil.Process(svc.pid or -1)
                procs = [proc, *proc.children(True)]
                out[name] = sum(sum(p.cpu_times()[:2]) for p in procs)
            except psutil.Error:
                continue
        return out

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            record = stack.read_stack(self.state_dir)
            if record is None:
                continue
            total = 0
            for svc in record.services.values():
                try:
                    proc = psutil.Process(svc.pid or -1)
                    total += sum(p.memory_info().rss for p in [proc, *proc.children(True)])
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)


class Bench:
    def __init__(self, tmp: Path, recipe: Path, overrides: list[str]):
        self.tmp, self.recipe, self.overrides = tmp, recipe, overrides
        self.settings: CliSettings = private_stack(tmp)
        self.state_dir = self.settings.state_dir.resolve()
        self.model_dir = (tmp / "models" / "base").resolve()
        self.base = load_recipe(recipe, [*overrides, f"model.path={self.model_dir}"])
        self.procs: list[subprocess.Popen] = []
        self.exits = contextlib.ExitStack()
        """What `stop` ends: the stack (`stack.owned`)."""
        self.init_version: int | None = None
        self.after_sft: dict[int, float] = {}

    # --- the stack and the shared warm-up ---------------------------------------------------
    def up(self, slots: int, max_batch: int, lanes: int, threads: int) -> None:
        """The stack, its rollout sized for many runs: `slots` tasks in flight (contended by
        N sync runs of 8 tasks a step, so the policy decides), `max_batch` rows a decode
        step (every run's rows in one step); its trainer's torch `lanes` (runs' steps side
        by side) and `threads` (0: the cores rollout's engine leaves it, so the two never
        fight over one; on 2 cores a second trainer thread on the engine's core made every
        step wait for it). The alone runs use the same stack."""
        m = self.base.model
        init_for(self.model_dir, m, self.base.trainer.seed)
        os.environ["TREADLE_ROLLOUT_MAX_CONCURRENT_TASKS"] = str(slots)
        os.environ["TREADLE_ROLLOUT_MAX_BATCH"] = str(max_batch)
        os.environ["TREADLE_TRAINER_TORCH_LANES"] = str(lanes)
        cores = os.cpu_count() or 2
        self.trainer_threads = threads or max(1, cores - cores // 2)  # rollout gets cores // 2
        os.environ["TREADLE_TRAINER_TORCH_THREADS"] = str(self.trainer_threads)
        spec = self.exits.enter_context(
            stack.owned(self.settings, self.model_dir, m.name, path_roots=[self.tmp])
        )
        if not stack.wait_healthy(self.state_dir, 180).healthy:
            raise RuntimeError(f"bench stack not healthy; logs in {self.state_dir}")
        self.spec = spec
        token = self.settings.client_token()
        self.http = stack.http(token)
        self.trainer = TrainerClient(spec.http_url("trainer"), self.http)
        self.rollout = RolloutClient(spec.http_url("rollout"), self.http)

    def config(self, seed: int) -> RunConfig:
        return load_recipe(self.recipe, [*self.overrides, f"model.path={self.model_dir}",
                                         f"trainer.seed={seed}"])  # fmt: skip

    async def warm_up(self, seeds: list[int]) -> None:
        """The recipe's SFT warm-up, once (seed 0's data); then each seed's held-out
        accuracy of the warmed-up policy (its `rl_lift` baseline)."""
        cfg = self.config(seeds[0])
        env = EnvClient(self.spec.grpc_addr("env-gateway"), token=self.settings.client_token())
        try:
            held = {s: await held_out_tasks(env, self.config(s)) for s in seeds}
            if cfg.sft.steps:
                data = await demonstrations(env, cfg, held[seeds[0]])
                checks = await validation_tasks(env, cfg, held[seeds[0]])
        finally:
            await env.close()
        if not cfg.sft.steps:
            return
        token = self.settings.client_token()
        async with TrainingSession(self.spec.http_url("trainer"), cfg, token) as session:

            async def validate(step: int, version: int) -> float:
                return self.evaluate(cfg, checks, version)

            warm = await session.sft(data, None, validate if checks else None)
        self.init_version = warm.version
        for seed in seeds:
            if held[seed]:
                self.after_sft[seed] = self.evaluate(self.config(seed), held[seed], warm.version)

    def evaluate(self, cfg: RunConfig, tasks: list[dict], version: int) -> float:
        deadline = time.monotonic() + 60
        while self.rollout.info().policy_version < version and time.monotonic() < deadline:
            time.sleep(0.2)
        request = EvaluateRequest(
            env=cfg.env.name,
            env_options=cfg.env.options,
            tasks=tasks,
            scorer=cfg.eval.scorer or cfg.scorer,
            scorer_options=cfg.scorer_options
            if cfg.eval.scorer_options is None
            else cfg.eval.scorer_options,  # fmt: skip
            max_turns=cfg.rollout.max_turns,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens,
        )
        return self.rollout.evaluate(request).mean_reward

    # --- runs -------------------------------------------------------------------------------
    def launch(self, spec: RunSpec, lora: list[str]) -> subprocess.Popen:
        sets = [
            f"run_id={spec.run_id}",
            f"trainer.seed={spec.seed}",
            f"model.path={self.model_dir}",
            f"output_dir={self.tmp / 'runs'}",
            f"scheduling.weight={spec.weight}",
            f"scheduling.priority={spec.priority}",
            "sft.steps=0",
            "eval.min_rl_improvement=null",
            "eval.min_improvement=null",
            *self.overrides,
            *lora,
        ]
        if self.init_version is not None:
            sets.append(f"model.init_version={self.init_version}")
        if spec.steps is not None:
            sets.append(f"trainer.num_steps={spec.steps}")
        log = open(self.tmp / f"{spec.run_id}.log", "wb")  # noqa: SIM115 - the child's
        treadle = str(Path(sys.executable).parent / "treadle")
        args = [a for s in sets for a in ("--set", s)]
        proc = subprocess.Popen(
            [treadle, "run", str(self.recipe), *args],
            env={**os.environ, "TREADLE_STATE_DIR": str(self.state_dir)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def phase(self, specs: list[RunSpec], lora: list[str]) -> Phase:
        """`specs` started at once; each result once all are done."""
        started = time.perf_counter()
        with RssSampler(self.state_dir) as rss:
            procs = [(s, self.launch(s, lora), time.perf_counter()) for s in specs]
            codes = {s.run_id: (p.wait(), time.perf_counter() - t) for s, p, t in procs}
        out = Phase(wall_s=time.perf_counter() - started, peak_rss_mb=rss.peak / 2**20)
        out.cpu_s = rss.cpu_s
        for spec in specs:
            code, wall = codes[spec.run_id]
            path = self.tmp / "runs" / spec.run_id / "summary.json"
            summary = json.loads(path.read_text()) if path.exists() else {}
            status = self.trainer.get_run(spec.run_id)
            out.results.append(
                RunResult(spec, code, wall, status, summary, self.trained_twice(spec.run_id))
            )
        return out

    def trained_twice(self, run_id: str) -> int:
        """Trajectory ids that more than one committed step of the run trained (its ledger)."""
        r = redis.Redis.from_url(self.spec.client_url("redis"))
        try:
            seen: set[str] = set()
            twice = 0
            entries: Any = r.xrange(names.ledger_stream(run_id))
            for _, fields in entries:
                for tid in json.loads(fields[b"trained"]):
                    twice += tid in seen
                    seen.add(tid)
            return twice
        finally:
            r.close()

    def lift(self, result: RunResult) -> float | None:
        end, base = result.summary.get("eval_end"), self.after_sft.get(result.spec.seed)
        if end is None:
            return None
        start = base if base is not None else result.summary.get("eval_start")
        return None if start is None else round(end - start, 4)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.exits.close()


def run(
    runs: int = 4,
    recipe: Path = DEMO_RECIPE,
    lora_rank: int = 8,
    steps: int | None = None,
    share_steps: int | None = None,
    overrides: list[str] | None = None,
    slots: int = 16,
    max_batch: int = 128,
    lanes: int = 1,
    trainer_threads: int = 0,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-multirun-"))
    bench = Bench(tmp, recipe, list(overrides or []))
    lora = [f"trainer.lora.rank={lora_rank}"]
    seeds = list(range(runs))
    try:
        bench.up(slots, max_batch, lanes, trainer_threads)
        asyncio.run(bench.warm_up(seeds))
        alone = [bench.phase([RunSpec(f"alone-{i}", i, steps=steps)], lora) for i in seeds]
        together = bench.phase([RunSpec(f"together-{i}", i, steps=steps) for i in seeds], lora)
        weights = [2.0] + [1.0] * (runs - 1)
        pairs = zip(seeds, weights, strict=True)
        weighted = bench.phase(
            [RunSpec(f"weighted-{i}", i, w, steps=share_steps) for i, w in pairs], lora
        )
        first = RunSpec("priority-alone", 0, steps=share_steps)
        prio_alone = bench.phase([first], lora).results[0]
        prio = bench.phase(
            [RunSpec(f"priority-{i}", i, priority=10 * (i == 0), steps=share_steps) for i in seeds],
            lora,
        )
    finally:
        bench.stop()
    report = _report(bench, alone, together, weighted, prio, prio_alone, weights)
    setup = {
        "lora_rank": lora_rank,
        "rollout_slots": slots,
        "rollout_max_batch": max_batch,
        "trainer_torch_lanes": lanes,
        "trainer_torch_threads": bench.trainer_threads,
    }
    return setup | report


def _report(
    bench: Bench,
    alone: list[Phase],
    together: Phase,
    weighted: Phase,
    prio: Phase,
    prio_alone: RunResult,
    weights: list[float],
) -> dict[str, Any]:
    """The bench's JSON from its phases."""
    seeds = [r.spec.seed for p in alone for r in p.results]
    runs = len(seeds)
    every = [r for p in (*alone, together, weighted, prio) for r in p.results] + [prio_alone]
    lone = {r.spec.seed: r for p in alone for r in p.results}
    return {
        "runs": runs,
        "recipe": bench.recipe.name,
        "overrides": bench.overrides,
        "init_version": bench.init_version,
        "eval_after_sft": bench.after_sft,
        "aggregate_speedup": round(sum(p.wall_s for p in alone) / together.wall_s, 3),
        "alone_wall_s": [round(p.wall_s, 1) for p in alone],
        "together_wall_s": round(together.wall_s, 1),
        "rl_lift_alone": [bench.lift(lone[i]) for i in seeds],
        "rl_lift_together": [bench.lift(r) for r in together.results],
        "jain_fairness": round(jain(window_rates(together.results)), 4),
        "share_error": round(share_error(window_rates(weighted.results), weights), 4),
        "weighted_rates": [round(x, 4) for x in window_rates(weighted.results)],
        "priority_slowdown": round(prio.results[0].s_per_step / prio_alone.s_per_step, 3),
        "s_per_step_alone": [round(lone[i].s_per_step, 3) for i in seeds],
        "s_per_step_together": [round(r.s_per_step, 3) for r in together.results],
        "cpu_s": {
            "alone": {k: round(sum(p.cpu_s.get(k, 0.0) for p in alone), 1) for k in together.cpu_s},
            "together": together.cpu_s,
        },  # fmt: skip
        "memory_ratio": round(together.peak_rss_mb / max(p.peak_rss_mb for p in alone), 3),
        "peak_rss_mb": {
            "alone": round(max(p.peak_rss_mb for p in alone), 1),
            "together": round(together.peak_rss_mb, 1),
        },  # fmt: skip
        "lost": sum(
            r.status.trajectories_produced
            - r.status.trajectories_consumed
            + (r.status.pending_after_run or 0)
            for r in every
        ),
        "trained_twice": sum(r.trained_twice for r in every),
        "all_succeeded": all(r.exit_code == 0 and r.status.state == "succeeded" for r in every),
        "outputs": str(bench.tmp),
    }
