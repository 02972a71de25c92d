"""A rollout task as the trainer feeds one: what tests hand an episode runner directly."""

from __future__ import annotations

import json

from treadle_common.proto.treadle.v1 import task_pb2


def env_task(
    env: str,
    row: dict,
    options: dict,
    *,
    temperature: float = 1.0,
    tokens: int = 5,
    seed: int = 0,
    max_turns: int = 1,
) -> task_pb2.Task:
    """One task of `env` (its dataset `row`, its `options`), scored by the env's own reward."""
    task = task_pb2.Task(
        task_id="t1",
        run_id="run",
        env=env,
        payload_json=json.dumps(row),
        env_options_json=json.dumps(options),
        scorer="env_reward",
        max_turns=max_turns,
    )
    task.sampling.temperature = temperature
    task.sampling.top_p = 1.0
    task.sampling.max_new_tokens = tokens
    task.sampling.seed = seed
    return task
