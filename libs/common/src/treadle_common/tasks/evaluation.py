"""Held-out evaluation: the eval split of a run's env, kept out of training and warm-up.

The trainer (task feeding), the SFT warm-up and `treadle run` (scoring through the rollout
service's `POST /v1/evaluate`) all derive the same held-out set from the recipe, so no
held-out task is ever trained on.
"""

from __future__ import annotations

from typing import Any

from treadle_common.clients.env import EnvClient
from treadle_common.config.recipe import RunConfig, task_key

EVAL_SPLIT = "eval"


async def held_out_tasks(env: EnvClient, config: RunConfig) -> list[dict[str, Any]]:
    """The recipe's eval tasks, without repeats (empty when `eval.num_tasks` is 0)."""
    if config.eval.num_tasks == 0:
        return []
    return await distinct_tasks(env, config, EVAL_SPLIT, config.eval.num_tasks)


async def distinct_tasks(
    env: EnvClient, config: RunConfig, split: str, num_tasks: int
) -> list[dict[str, Any]]:
    """`num_tasks` tasks of the run's env from `split` (seeded by the run), repeats removed."""
    rows = await env.sample_tasks(
        config.env.name,
        num_tasks,
        seed=config.trainer.seed,
        split=split,
        options=config.env.options,
    )
    return distinct(rows)


def distinct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` without repeats, in first-seen order."""
    unique: dict[str, dict[str, Any]] = {}
    for row in rows:
        unique.setdefault(task_key(row), row)
    return list(unique.values())


def without_held_out(
    rows: list[dict[str, Any]], held_out: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`rows` minus every task of the held-out set."""
    keys = {task_key(t) for t in held_out}
    return [r for r in rows if task_key(r) not in keys]
