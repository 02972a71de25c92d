"""`treadle bench learn`: does RL itself improve held-out accuracy, on every seed?

Runs the demo recipe (`recipes/demo.yaml`: a partial SFT warm-up, then GRPO) once per seed,
through `treadle run` itself, on one private stack (own Redis/NATS, free ports). Per seed:

- `eval_start`: held-out greedy accuracy of the untrained model;
- `eval_after_sft`: after the warm-up (stopped at `sft.target_reward` on a validation split);
- `eval_end`: after the RL phase;
- `rl_lift` = eval_end - eval_after_sft (eval_start without a warm-up): what RL alone gained
  on problems it never saw;
- `sft_steps`, `rl_steps`, `wall_s` (the whole `treadle run`: evaluations, warm-up, RL);
- `generated_tokens_per_s`, `trained_tokens_per_s`, `weight_bytes_per_step`: the RL phase's
  rates from the run's accounting (`_throughput`).

A recipe whose `model.path` is an imported model (`treadle model import`) trains it; any
other gets one tiny model built here.

`min_rl_lift` is the smallest `rl_lift` over the seeds: the number to gate on.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from treadle_bench.harness import private_stack
from treadle_cli import stack
from treadle_cli.report import RunReport
from treadle_cli.run_client import RunClient, RunSummary
from treadle_cli.tiny_model import init_for
from treadle_common.config.recipe import load_recipe

DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"


def run(
    seeds: list[int], recipe: Path = DEMO_RECIPE, overrides: list[str] | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-learn-"))
    console = Console(file=sys.stderr)
    settings = private_stack(tmp)
    named = load_recipe(recipe, overrides or []).model
    # a recipe naming an imported model (a directory with its config) trains that one;
    # otherwise one tiny model (the first seed's init) on one stack: seeds vary data,
    # warm-up and sampling
    imported = (named.path / "config.json").is_file()
    model_dir = named.path.resolve() if imported else (tmp / "models" / "tiny").resolve()
    configs = [
        load_recipe(
            recipe,
            [
                f"trainer.seed={seed}",
                f"run_id=learn-seed{seed}",
                f"model.path={model_dir}",
                f"output_dir={tmp / 'runs'}",
                *(overrides or []),
            ],
        )
        for seed in seeds
    ]
    m = configs[0].model
    if not imported:
        init_for(model_dir, m, configs[0].trainer.seed)
    roots = [tmp, model_dir.parent]
    per_seed: list[dict[str, Any]] = []
    with stack.owned(settings, model_dir, m.name, path_roots=roots):
        if not stack.wait_healthy(settings.state_dir.resolve(), 180).healthy:
            raise RuntimeError(f"bench stack not healthy; logs in {settings.state_dir}")
        for seed, cfg in zip(seeds, configs, strict=True):
            started = time.perf_counter()
            code = RunClient(cfg, settings, console).execute(health_timeout_s=180)
            per_seed.append(_seed_row(seed, code, cfg.output_dir / cfg.run_id, started))
    lifts = [s["rl_lift"] for s in per_seed]
    return {
        "recipe": recipe.name,
        "seeds": per_seed,
        "min_rl_lift": min(lifts) if None not in lifts else None,
        "mean_rl_lift": round(sum(lifts) / len(lifts), 4) if None not in lifts else None,
        "max_wall_s": max(s["wall_s"] for s in per_seed),
        "all_exit_zero": all(s["exit_code"] == 0 for s in per_seed),
        "outputs": str(tmp),
    }


def _seed_row(seed: int, code: int, out_dir: Path, started: float) -> dict[str, Any]:
    """One seed's evaluations, steps and rates, from what its run left in `out_dir`."""
    report = RunReport.load(out_dir)
    e, evals = report.eval_summary(), report.evals()
    return {
        "seed": seed,
        "exit_code": code,
        "eval_start": e.eval_start,
        "eval_after_sft": e.eval_after_sft,
        "eval_end": e.eval_end,
        "rl_lift": e.rl_lift,
        "held_out_tasks": evals[0].num_tasks if evals else 0,
        "sft_steps": len(report.sft()),
        "rl_steps": len(report.steps()),
        "wall_s": round(time.perf_counter() - started, 1),
        **_throughput(out_dir, report),
    }


def _throughput(out_dir: Path, report: RunReport) -> dict[str, Any]:
    """The RL phase's rates from the run's own accounting (`summary.json`): generated tokens
    per second of the phase's wall time (from its first step's start to its last step's
    end), trained tokens per second of the trainer's compute, and the weight bytes a step
    published (an adapter's, for a LoRA run)."""
    usage = RunSummary.model_validate_json((out_dir / "summary.json").read_text()).usage
    steps = report.steps()
    if not steps:
        return {}
    rl_s = steps[-1].t - steps[0].t + steps[0].duration_s
    return {
        "rl_wall_s": round(rl_s, 1),
        "generated_tokens_per_s": round(usage.generated_tokens / rl_s, 1),
        "trained_tokens_per_s": round(usage.trained_tokens / max(usage.trainer_s, 1e-9), 1),
        "weight_bytes_per_step": round(usage.weight_bytes_published / len(steps)),
    }
