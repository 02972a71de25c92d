"""`treadle bench step`: what the service path costs on a short, compute-bound step.

One workload (`recipes/step.yaml`: two-digit addition after a partial SFT warm-up, 8 prompts x
8 completions per step, at most 8 new tokens, exact match, PPO + GRPO), three ways, from the
same warmed-up weights, for the same number of steps:

- `inproc`: one process, no services: the rollout service's engine (`HFEngine`), the env and
  the scorer called directly, the trainer's own training code (`train_batch`), and the new
  weights copied into the engine in place. The floor Treadle is measured against;
- `sync` and `async` (staleness 2): `treadle run` on a private stack, like every user run.

Per way, `*_s_per_step` is wall time per step after the first (which fills the pipeline):
from the end of step 1 to the end of the last. `sync_ratio` = inproc / sync (1.0 = no
overhead), `async_over_sync` = async / sync (< 1: async pays for itself). The breakdown is
the median step's `wait_for_batch_s`, `train_s` and `publish_s` (time the step was blocked on
publishing); `publish_p50_s` / `publish_p99_s` are the publishes themselves (async run), and
`publish_stall_ratio` their p99 / p50. `log_errors` counts error lines the services logged
during the two runs (a GC or publish error shows up there).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from treadle_bench import e2e
from treadle_cli import stack
from treadle_cli.report import RunReport, StepRow
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config.recipe import RunConfig, load_recipe
from treadle_common.model.export import export_hf

STEP_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "step.yaml"
ERROR_LINE = re.compile(r"\[error\s*\]|Traceback \(most recent call last\)")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def per_step(finished: list[float]) -> float:
    """Wall seconds per step after the first, from the steps' end times."""
    if len(finished) < 2:
        return 0.0
    return (finished[-1] - finished[0]) / (len(finished) - 1)


def breakdown(steps: list[StepRow]) -> dict[str, float]:
    rest = steps[1:] or steps
    published = [s.publish_duration_s for s in rest if s.publish_duration_s]
    p50, p99 = _quantile(published, 0.5), _quantile(published, 0.99)
    return {
        "s_per_step": per_step([s.finished_at for s in steps]),
        "wait_for_batch_s": statistics.median(s.wait_for_batch_s for s in rest),
        "train_s": statistics.median(s.train_s for s in rest),
        "publish_s": statistics.median(s.publish_s for s in rest),
        "publish_p50_s": p50,
        "publish_p99_s": p99,
        "publish_stall_ratio": p99 / p50 if p50 else 0.0,
        "versions_published": len(published),
        "reward_first": steps[0].mean_reward,
        "reward_last": statistics.fmean(s.mean_reward for s in steps[-10:]),
    }


def log_errors(state_dir: Path) -> list[str]:
    lines = []
    for log in sorted((state_dir / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if ERROR_LINE.search(line):
                lines.append(f"{log.stem}: {line.strip()[:300]}")
    return lines


async def _export(address: str, token: str | None, model: str, version: int, out: Path) -> None:
    client = WeightStoreClient(address, token=token)
    try:
        await export_hf(client, model, version, out)
    finally:
        await client.close()


class _InProc:
    """The workload's pieces in one process: the engine, the backend, the env and the scorer."""

    def __init__(self, model_dir: Path, cfg: RunConfig, steps: int) -> None:
        from treadle_env_gateway.public import env_registry
        from treadle_reward.public import scorer_registry
        from treadle_rollout.public import HFEngine
        from treadle_trainer.public import AdamParams, BackendSpec, LossParams, build_backend

        t, r = cfg.trainer, cfg.rollout
        self.cfg = cfg
        self.engine = HFEngine(model_dir, cfg.model.name)
        self.backend = build_backend(BackendSpec(model_dir=str(model_dir), seed=t.seed, bf16=False))
        self.env_cls = env_registry()[cfg.env.name]
        self.scorer = scorer_registry()[cfg.scorer]
        self.tasks = self.env_cls.sample_tasks(
            steps * t.tasks_per_step, t.seed, "train", cfg.env.options
        )
        self.loss = LossParams(
            clip_low=t.clip_low,
            clip_high=t.clip_high,
            is_cap=t.is_cap,
            kl_coef=t.kl_coef,
            temperature=r.sampling.temperature or 1.0,
        )
        self.adam = AdamParams(learning_rate=t.lr, max_grad_norm=t.max_grad_norm)

    async def episode(self, index: int, sample: int):
        from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
        from treadle_env_gateway.public import Action
        from treadle_reward.public import ScoreInput
        from treadle_rollout.public import Sampling, Transcript
        from treadle_trainer.public import task_seed

        cfg, task = self.cfg, self.tasks[index]
        t, r = cfg.trainer, cfg.rollout
        env = self.env_cls(cfg.env.options)
        transcript = Transcript(self.engine.tokenizer)
        messages = await env.reset(task, seed=sample)
        transcript.add_messages([{"role": m.role, "content": m.content} for m in messages])
        sampling = Sampling(
            temperature=r.sampling.temperature,
            top_p=r.sampling.top_p or 1.0,
            max_new_tokens=r.sampling.max_new_tokens,
            seed=task_seed(t.seed, index, r.group_size) + sample,
            last_turn=True,  # single turn, as rollout tells the engine
        )
        gen = await self.engine.generate(transcript.tokens, sampling)
        text = transcript.add_generation(gen)
        result = await env.step(Action(text=text))
        score = await self.scorer.score(
            ScoreInput(task=task, answer=text, info=result.info, options=cfg.scorer_options)
        )
        traj = tpb.Trajectory(group_id=str(index), sample_index=sample, reward=score.reward)
        transcript.fill(traj)
        return traj

    def train(self, groups: list, step: int) -> None:
        from treadle_trainer.public import Datum, group_advantages, train_batch

        t = self.cfg.trainer
        data = [
            Datum.from_trajectory(traj, adv)
            for group in groups
            for traj, adv in zip(group, group_advantages(group, t.advantage), strict=True)
        ]
        train_batch(self.backend, data, t, self.loss, self.adam, step)  # nothing else to run

    def load(self) -> None:
        """The trained weights into the engine, in place."""
        import torch

        state = self.backend.state_dict_cpu()
        with torch.inference_mode():
            for name, tensor in self.engine.model.state_dict().items():
                tensor.copy_(state[name])
        self.engine.version += 1
        self.engine.prefixes.clear()  # cached KV belongs to the old weights


async def inproc_loop(model_dir: Path, cfg: RunConfig, steps: int) -> dict[str, Any]:
    """The workload in one process: generate -> score -> train -> load the weights in place."""
    loop = _InProc(model_dir, cfg, steps)
    tasks, size = cfg.trainer.tasks_per_step, cfg.rollout.group_size
    finished: list[float] = []
    stages: dict[str, list[float]] = {"generate_s": [], "train_s": [], "load_s": []}
    rewards: list[float] = []
    for step in range(steps):
        started = time.perf_counter()
        batch = range(step * tasks, (step + 1) * tasks)
        groups = await asyncio.gather(
            *(asyncio.gather(*(loop.episode(i, k) for k in range(size))) for i in batch)
        )
        generated = time.perf_counter()
        loop.train(list(groups), step + 1)
        trained = time.perf_counter()
        loop.load()
        done = time.perf_counter()
        stages["generate_s"].append(generated - started)
        stages["train_s"].append(trained - generated)
        stages["load_s"].append(done - trained)
        rewards.append(statistics.fmean(traj.reward for g in groups for traj in g))
        finished.append(done)
    await loop.engine.close()
    return {
        "s_per_step": per_step(finished),
        **{k: statistics.median(v[1:] or v) for k, v in stages.items()},
        "reward_first": rewards[0],
        "reward_last": statistics.fmean(rewards[-10:]),
    }


def run(steps: int = 100, recipe: Path = STEP_RECIPE, overrides: list[str] | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-step-"))
    console = Console(file=sys.stderr)
    os.environ.setdefault("TREADLE_LOG_LEVEL", "WARNING")
    warm_dir = tmp / "warm"
    errors: list[str] = []

    def export_warm(spec: stack.StackSpec, sync_config: RunConfig) -> None:
        version = sync_config.model.init_version
        if version is None:
            raise RuntimeError("the sync run left no warmed-up version to start from")
        address = spec.grpc_addr("weight-store")
        token = stack.token_for(Path(spec.state_dir))
        asyncio.run(_export(address, token, sync_config.model.name, version, warm_dir))
        errors.extend(log_errors(Path(spec.state_dir)))

    stack_dir = tmp / "stack"
    config, _ = e2e.both_modes(
        recipe,
        stack_dir,
        [f"trainer.num_steps={steps}", *(overrides or [])],
        console,
        before_down=export_warm,
    )
    sync = breakdown(RunReport.load(stack_dir / "runs" / "bench-sync").steps())
    asyn = breakdown(RunReport.load(stack_dir / "runs" / "bench-async").steps())
    inproc_cfg = load_recipe(recipe, [f"trainer.num_steps={steps}", *(overrides or [])])
    inproc = asyncio.run(inproc_loop(warm_dir, inproc_cfg, steps))
    result = {
        "workload": recipe.name,
        "steps": steps,
        "tasks_per_step": config["trainer"]["tasks_per_step"],
        "group_size": config["rollout"]["group_size"],
        "max_new_tokens": config["rollout"]["sampling"]["max_new_tokens"],
        "max_staleness": config["trainer"]["max_staleness"],
        "inproc_s_per_step": round(inproc["s_per_step"], 4),
        "sync_s_per_step": round(sync["s_per_step"], 4),
        "async_s_per_step": round(asyn["s_per_step"], 4),
        "sync_ratio": round(inproc["s_per_step"] / sync["s_per_step"], 3),
        "async_over_sync": round(asyn["s_per_step"] / sync["s_per_step"], 3),
        "publish_p50_s": round(asyn["publish_p50_s"], 4),
        "publish_p99_s": round(asyn["publish_p99_s"], 4),
        "publish_stall_ratio": round(asyn["publish_stall_ratio"], 2),
        "log_errors": len(errors),
        "breakdown": {
            "inproc": {k: round(v, 4) for k, v in inproc.items()},
            "sync": {k: round(v, 4) for k, v in sync.items()},
            "async": {k: round(v, 4) for k, v in asyn.items()},
        },
        "log_error_samples": errors[:5],
        "outputs": str(tmp),
    }
    (tmp / "result.json").write_text(json.dumps(result, indent=2))
    return result
