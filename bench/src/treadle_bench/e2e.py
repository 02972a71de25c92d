"""`treadle bench e2e`: the same recipe in `sync` and in `async` mode on one stack.

Both modes run the agentic workload (`recipes/agentic.yaml`: multi-turn, heavy-tailed tool
latency, long-tail lengths) for the same number of trainer steps from the same initial
weights, through `treadle run` itself, on a private stack (own Redis/NATS, free ports).

- `sync_s` / `async_s`: training wall-clock time, from the start of step 1 (feeding its
  tasks) to the publish of the last step, from the trainer's step records;
- `speedup` = sync_s / async_s;
- `trainer_idle_fraction_async`: time the trainer waited for batches / its wall-clock time,
  steps 2..N (step 1 is the pipeline fill, in both modes; `..._incl_fill` counts it);
- `rollout_engine_busy_fraction_*`: the share of each run's time the rollout engine was
  generating (the other side of the trainer's idle time);
- `max_staleness_seen`: the largest policy lag of a trained trajectory in async mode;
- `eval_reward_sync` / `eval_reward_async`: greedy held-out reward of the agentic workload
  after each run (the tiny model never guesses: 0 in both);
- the learning half (`--quality-recipe`, by default `recipes/arith_latency.yaml`: the demo's
  two-digit addition behind the same kind of heavy-tailed tool latency, learnable by the
  tiny model): sync first (with its SFT warm-up), then async (staleness 2) from the warm-up's
  version, for the same steps. `eval_start` is held-out accuracy where both began,
  `eval_sync` / `eval_async` where they ended, `eval_gain_sync` = sync - start and
  `eval_gap_async_vs_sync` = async - sync; `quality_speedup` is this workload's sync/async
  training wall-time ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from treadle_bench.harness import private_stack
from treadle_cli import stack
from treadle_cli.report import RunReport, StepRow
from treadle_cli.run_client import RunClient
from treadle_cli.settings import CliSettings
from treadle_cli.tiny_model import init_for
from treadle_common.config.recipe import RunConfig, load_recipe
from treadle_common.proto.treadle.v1 import schedule_pb2

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = RECIPES / "agentic.yaml"
QUALITY_RECIPE = RECIPES / "arith_latency.yaml"
ENGINE_COUNTS = ("decode_steps", "decode_rows", "prefill_forwards")


def _timings(steps: list[StepRow]) -> dict[str, float]:
    first_start = steps[0].finished_at - steps[0].duration_s
    wall = steps[-1].finished_at - first_start
    rest = steps[1:] or steps  # step 1 fills the pipeline
    after_fill = steps[-1].finished_at - (rest[0].finished_at - rest[0].duration_s)
    wait_after_fill = sum(s.wait_for_batch_s for s in rest)
    return {
        "wall_s": wall,
        "idle_fraction": wait_after_fill / after_fill if after_fill > 0 else 0.0,
        "idle_fraction_incl_fill": sum(s.wait_for_batch_s for s in steps) / wall,
        "max_staleness": max(s.max_staleness for s in steps),
        "step_s_p50": sorted(s.duration_s for s in steps)[len(steps) // 2],
    }


def both_modes(
    recipe: Path,
    tmp: Path,
    overrides: list[str],
    console: Console,
    before_down: Callable[[stack.StackSpec, RunConfig], None] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Run `recipe` in sync, then async mode, on one private stack; per-mode results.

    A recipe with an SFT warm-up warms up once, in the sync run: the async run starts from
    the warm-up's weight-store version, so both modes train from the same weights.
    `before_down(spec, sync_config)` runs once both did, while the stack is still up."""
    settings = private_stack(tmp)
    model_dir = tmp / "models" / "tiny"

    def config(mode: str, *extra: str) -> RunConfig:
        return load_recipe(
            recipe,
            [
                f"mode={mode}",
                f"run_id=bench-{mode}",
                f"model.path={model_dir}",
                f"output_dir={tmp / 'runs'}",
                "eval.min_improvement=null",  # the bench compares the modes' rewards itself
                "eval.min_rl_improvement=null",
                *overrides,
                *extra,
            ],
        )

    sync_config = config("sync")
    m = sync_config.model
    init_for(model_dir, m, sync_config.trainer.seed)
    results: dict[str, dict[str, Any]] = {}
    with stack.owned(settings, model_dir.resolve(), m.name, path_roots=[tmp]) as spec:
        if not stack.wait_healthy(settings.state_dir.resolve(), 180).healthy:
            raise RuntimeError(f"bench stack not healthy; logs in {settings.state_dir}")
        rollout_info = f"{spec.http_url('rollout')}/v1/info"
        cfg = sync_config
        for mode in ("sync", "async"):
            if mode == "async":
                warmed = sync_config.model.init_version if sync_config.sft.steps else None
                start = [f"model.init_version={warmed}", "sft.steps=0"] if warmed else []
                cfg = config("async", *start)
            results[mode] = _one_run(cfg, settings, console, rollout_info)
        if before_down is not None:
            before_down(spec, sync_config)
    return cfg.model_dump(), results


def _one_run(cfg: RunConfig, settings: CliSettings, console: Console, rollout_info: str) -> dict:
    """One run on the stack: its step timings, held-out rewards, wall time and how busy the
    rollout engine was meanwhile."""
    started = time.perf_counter()
    http = stack.http(settings.client_token())
    before = http.get(rollout_info, timeout=10).json()
    cpu_before = _service_cpu(settings)
    code = RunClient(cfg, settings, console).execute(health_timeout_s=180)
    after = http.get(rollout_info, timeout=10).json()
    cpu = {k: round(v - cpu_before.get(k, v), 3) for k, v in _service_cpu(settings).items()}
    busy = after["engine_busy_s"] - before["engine_busy_s"]
    if code != 0:
        raise RuntimeError(f"{cfg.mode} run failed; outputs in {cfg.output_dir}")
    report = RunReport.load(cfg.output_dir / cfg.run_id)
    return {
        **_timings(report.steps()),
        **report.eval_summary().model_dump(exclude_none=True),
        "run_s": time.perf_counter() - started,
        "rollout_busy": busy / (time.perf_counter() - started),
        "train_reward_last": report.steps()[-1].mean_reward,
        "components": {
            **_components(report.steps(), before, after),
            "service_cpu_s": cpu,
            "episode_env_s": _episode_env_s(cfg.output_dir / cfg.run_id / "schedule"),
        },
    }


def _episode_env_s(schedule: Path) -> list[list[float]]:
    """Each trained episode's seconds in env steps, per task in the order the trainer fed
    them and per sample (from the run's recorded schedule, `treadle replay`'s input). Tool
    latency is seeded by the task and the sample, so both modes draw the same: the
    simulator's calibration plays these instead of drawing its own."""
    by_task: dict[int, dict[int, float]] = {}
    for path in sorted(schedule.glob("step-*.binpb")):
        step = schedule_pb2.ScheduleStep.FromString(path.read_bytes())
        for group in step.groups:
            for entry in group.entries:
                traj = entry.trajectory
                fed = int(traj.task_id.split("-", 1)[0])
                by_task.setdefault(fed, {})[traj.sample_index] = round(traj.timings.env_s, 4)
    out: list[list[float]] = []
    for fed in range(max(by_task, default=-1) + 1):  # stops at the first task not trained
        samples = by_task.get(fed, {})
        if not samples or sorted(samples) != list(range(len(samples))):
            break
        out.append([samples[i] for i in range(len(samples))])
    return out


def _service_cpu(settings: CliSettings) -> dict[str, float]:
    """CPU seconds each service's own process has used so far (its children, as rollout's
    engine process, are not in it: the engine's time is `engine_busy_s`)."""
    out: dict[str, float] = {}
    for name, service in stack.status(settings.state_dir.resolve()).services.items():
        if service.pid is None:
            continue
        try:
            times = psutil.Process(service.pid).cpu_times()
        except psutil.Error:  # restarted or gone: no reading
            continue
        out[name] = times.user + times.system
    return out


def _components(steps: list[StepRow], before: dict, after: dict) -> dict[str, float]:
    """What each part cost in this run, for the simulator's calibration (`treadle sim
    calibrate e2e`): the trainer's step and publish (medians), and the engine's seconds per
    decode step (its busy time, prefill included, over its decode steps)."""
    counts = {  # an engine that keeps no such counts (vLLM's) reports 0 decode steps
        k: after["engine_stats"].get(k, 0) - before["engine_stats"].get(k, 0) for k in ENGINE_COUNTS
    }
    busy = after["engine_busy_s"] - before["engine_busy_s"]
    steps_run = max(counts["decode_steps"], 1)
    return {
        "train_s": round(statistics.median(s.train_s for s in steps), 4),
        "publish_s": round(statistics.median(s.publish_s for s in steps), 4),
        "engine_busy_s": round(busy, 3),
        **counts,
        "engine_s_per_decode_step": round(busy / steps_run, 6),
        "decode_rows_per_step": round(counts["decode_rows"] / steps_run, 2),
    }


def _start(sync: dict[str, Any]) -> float | None:
    """Held-out reward of the weights both modes' RL started from."""
    return sync.get("eval_after_sft", sync.get("eval_start"))


def _quality(recipe: Path, tmp: Path, overrides: list[str], console: Console) -> dict[str, Any]:
    """Both modes on a task the model can learn: their held-out gains and wall times."""
    q_config, learned = both_modes(recipe, tmp, overrides, console)
    q_sync, q_async = learned["sync"], learned["async"]
    start = _start(q_sync)
    return {
        "quality_workload": recipe.name,
        "quality_steps": q_config["trainer"]["num_steps"],
        "quality_max_staleness": q_config["trainer"]["max_staleness"],
        "eval_start": start,
        "eval_sync": q_sync["eval_end"],
        "eval_async": q_async["eval_end"],
        "eval_gain_sync": round(q_sync["eval_end"] - start, 4),
        "eval_gain_async": round(q_async["eval_end"] - start, 4),
        "eval_gap_async_vs_sync": round(q_async["eval_end"] - q_sync["eval_end"], 4),
        "quality_sync_s": round(q_sync["wall_s"], 2),
        "quality_async_s": round(q_async["wall_s"], 2),
        "quality_speedup": round(q_sync["wall_s"] / q_async["wall_s"], 3),
        "quality_max_staleness_seen": q_async["max_staleness"],
    }


def run(
    recipe: Path = DEFAULT_RECIPE,
    steps: int = 12,
    max_concurrent_tasks: int = 64,
    quality_recipe: Path | None = QUALITY_RECIPE,
    quality_overrides: list[str] | None = None,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-e2e-"))
    console = Console(file=sys.stderr)
    # every service of the stacks inherits these
    os.environ["TREADLE_ROLLOUT_MAX_CONCURRENT_TASKS"] = str(max_concurrent_tasks)
    os.environ.setdefault("TREADLE_LOG_LEVEL", "WARNING")
    config, results = both_modes(recipe, tmp / "workload", [f"trainer.num_steps={steps}"], console)
    quality: dict[str, Any] = {}
    if quality_recipe is not None:  # a task the model can learn: does async learn as well?
        quality = _quality(quality_recipe, tmp / "quality", quality_overrides or [], console)
    sync, asyn = results["sync"], results["async"]
    return {
        "workload": recipe.name,
        "steps": steps,
        "tasks_per_step": config["trainer"]["tasks_per_step"],
        "group_size": config["rollout"]["group_size"],
        "max_staleness": config["trainer"]["max_staleness"],
        "minibatches": config["trainer"]["minibatches"],
        "rollout_max_concurrent_tasks": max_concurrent_tasks,
        "workload_config": {
            "env": config["env"],
            "rollout": config["rollout"],
            "trainer": {k: config["trainer"][k] for k in ("max_staleness", "publish_every")},
        },
        "components": {"sync": sync["components"], "async": asyn["components"]},
        "sync_s": round(sync["wall_s"], 2),
        "async_s": round(asyn["wall_s"], 2),
        "speedup": round(sync["wall_s"] / asyn["wall_s"], 3),
        "trainer_idle_fraction_sync": round(sync["idle_fraction"], 3),
        "trainer_idle_fraction_async": round(asyn["idle_fraction"], 3),
        "trainer_idle_fraction_async_incl_fill": round(asyn["idle_fraction_incl_fill"], 3),
        "rollout_engine_busy_fraction_sync": round(sync["rollout_busy"], 3),
        "rollout_engine_busy_fraction_async": round(asyn["rollout_busy"], 3),
        "max_staleness_seen": asyn["max_staleness"],
        "max_staleness_seen_sync": sync["max_staleness"],
        "step_s_p50_sync": round(sync["step_s_p50"], 3),
        "step_s_p50_async": round(asyn["step_s_p50"], 3),
        "eval_reward_sync": sync.get("eval_end"),
        "eval_reward_async": asyn.get("eval_end"),
        "train_reward_last_sync": round(sync["train_reward_last"], 4),
        "train_reward_last_async": round(asyn["train_reward_last"], 4),
        **quality,
        "outputs": str(tmp),
    }
