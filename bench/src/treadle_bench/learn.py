"""`treadle bench learn`: does RL itself improve held-out accuracy, on every seed?

Runs the demo recipe (`recipes/demo.yaml`: a partial SFT warm-up, then GRPO) once per seed,
through `treadle run` itself, on one private stack (own Redis/NATS, free ports). Per seed:

- `eval_start`: held-out greedy accuracy of the untrained model;
- `eval_after_sft`: after the warm-up (stopped at `sft.target_reward` on a validation split);
- `eval_end`: after the RL phase;
- `rl_lift` = eval_end - eval_after_sft: what RL alone gained on problems it never saw;
- `sft_steps`, `rl_steps`, `wall_s` (the whole `treadle run`: evaluations, warm-up, RL).

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
from treadle_cli.run_client import RunClient
from treadle_cli.tiny_model import init_for
from treadle_common.config.recipe import load_recipe

DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"


def run(
    seeds: list[int], recipe: Path = DEMO_RECIPE, overrides: list[str] | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-learn-"))
    console = Console(file=sys.stderr)
    settings = private_stack(tmp)
    model_dir = (tmp / "models" / "tiny").resolve()
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
    # one model (the first seed's init) on one stack: seeds vary data, warm-up and sampling
    init_for(model_dir, m, configs[0].trainer.seed)
    per_seed: list[dict[str, Any]] = []
    with stack.owned(settings, model_dir, m.name, path_roots=[tmp]):
        if not stack.wait_healthy(settings.state_dir.resolve(), 180).healthy:
            raise RuntimeError(f"bench stack not healthy; logs in {settings.state_dir}")
        for seed, cfg in zip(seeds, configs, strict=True):
            started = time.perf_counter()
            code = RunClient(cfg, settings, console).execute(health_timeout_s=180)
            report = RunReport.load(cfg.output_dir / cfg.run_id)
            e, evals = report.eval_summary(), report.evals()
            per_seed.append(
                {
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
                }
            )
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
