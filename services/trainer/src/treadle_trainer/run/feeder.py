"""Feeding a run's tasks to rollout, and taking back the ones no step needs at the end.

    dataset / env generator --cursor--> fenced MULTI (`lease.py`): XADD treadle:{run}:tasks
        + cursor + fed ids

Tasks are fed up to (step + max_staleness) * tasks_per_step; rollout's admission does the
rest. Each task's id sorts in feed order and carries its own sampling seed (`task_seed`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid

import redis.asyncio as aioredis
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from treadle_common import names
from treadle_common.api.runs import RunStatus
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import breaker
from treadle_common.proto.treadle.v1 import common_pb2, task_pb2
from treadle_common.runtime import tracing
from treadle_common.tasks.evaluation import held_out_tasks, without_held_out
from treadle_trainer.data import DatasetError, TaskSource, load_rows
from treadle_trainer.run.lease import Lease


def task_seed(run_seed: int, index: int, group_size: int) -> int:
    """The sampling seed of the run's `index`-th task: its episodes take seed + 0 .. seed +
    group_size - 1, so no two episodes of a run share one (and 0, unseeded, is never used)."""
    return (run_seed % 2**20) * 2**40 + index * group_size + 1


async def task_source(config: RunConfig, env: EnvClient, count: int) -> TaskSource:
    """The dataset, or `count` tasks of the env's generator, minus the held-out eval tasks."""
    if config.data.path is not None:
        rows = await asyncio.to_thread(load_rows, config.data.path)
    else:
        rows = await env.sample_tasks(
            config.env.name, count, seed=config.trainer.seed, options=config.env.options
        )
    rows = without_held_out(rows, await held_out_tasks(env, config))
    if not rows:
        raise DatasetError("every training task is in the held-out eval set")
    seed, shuffle = config.trainer.seed, config.data.path is not None and config.data.shuffle
    return TaskSource(rows, seed, shuffle)


COUNTS = (
    "tasks_cancelled",
    "tasks_dead",
    "groups_unusable",
    "trajectories_quarantined",
    "trajectories_discarded",
)


class EnvCircuitOpen(RuntimeError):
    """The run's env failed too many of its episodes (`fleet.breaker`): the run fails."""

    @classmethod
    def of(cls, config: RunConfig, why: str) -> EnvCircuitOpen:
        return cls(f"env {config.env.name!r} is circuit-broken for run {config.run_id}: {why}")


def _is_count(name: str, number: str) -> bool:
    counted = name.startswith("dead:") or name in COUNTS
    return counted and number.lstrip("-").isdigit()


class Feeder:
    def __init__(self, config: RunConfig, r: aioredis.Redis, status: RunStatus, lease: Lease):
        self.config = config
        self.r = r
        self.status = status
        self.lease = lease
        self.fed: set[str] = set()
        """Every task id this run fed: a trajectory of any other group is not ours."""

    async def restore(self) -> None:
        """The cursor and the fed ids, as the last owner left them in Redis."""
        run = self.config.run_id
        fed = await self.r.hget(names.run_state(run), "tasks_fed")
        self.status.tasks_fed = int(fed or 0)
        self.fed.clear()  # in place: the collector checks groups against this set
        self.fed.update(streams.text(m) for m in await self.r.smembers(names.fed_tasks(run)))

    async def feed(self, source: TaskSource, upto: int, min_version: int) -> int:
        """Feed tasks until `upto` live ones were fed (cancelled and dead ones are replaced);
        the cursor, the tasks and their ids move in one transaction; how many were fed.
        `min_version` > 0: the version rollout must hold before generating for them. Raises
        `EnvCircuitOpen` once the run's env is circuit-broken."""
        cfg = self.config
        cursor = self.status.tasks_fed
        lost = await self.refresh()
        self.check_env()
        if cursor - lost >= upto:
            return 0
        upto += lost  # the new cursor: cancelled and dead tasks do not count toward the bound
        # ids sort in feed order (a step trains its groups in that order, whatever order they
        # arrive in); the suffix keeps them unique if a run id is ever reused
        ids = [f"{i:09d}-{uuid.uuid4().hex[:12]}" for i in range(cursor, upto)]
        tasks = [
            self._task(i, task_id, payload, min_version)
            for i, (task_id, payload) in enumerate(
                zip(ids, source.take(cursor, upto - cursor), strict=True), start=cursor
            )
        ]

        async def queue(pipe: aioredis.client.Pipeline) -> None:  # fenced: ours only
            for task in tasks:
                await streams.add(pipe, names.tasks_stream(cfg.run_id), task)
            pipe.sadd(names.fed_tasks(cfg.run_id), *ids)
            pipe.hset(names.run_state(cfg.run_id), "tasks_fed", upto)

        await self.lease.transaction(queue)
        self.fed.update(ids)
        self.status.tasks_fed = upto
        return len(ids)

    async def refresh(self) -> int:
        """Read rollout's counts of this run's cancelled and dead-lettered tasks into the
        status; how many fed tasks will never produce a group a step can train."""
        state = await self.r.hgetall(names.run_state(self.config.run_id))
        text = {streams.text(k): streams.text(v) for k, v in state.items()}
        self.status.usage.take_rollout(text)
        counts = {k: int(v) for k, v in text.items() if _is_count(k, v)}
        self.status.tasks_cancelled = counts.get("tasks_cancelled", 0)
        self.status.tasks_dead = counts.get("tasks_dead", 0)
        self.status.dead_lettered = {
            k.removeprefix("dead:"): n for k, n in counts.items() if k.startswith("dead:")
        }
        self.status.trajectories_quarantined = counts.get("trajectories_quarantined", 0)
        self.status.trajectories_discarded = counts.get("trajectories_discarded", 0)
        self.status.broken_envs = breaker.open_in(text)
        unusable = counts.get("groups_unusable", 0)  # taken, but no step could train them
        return self.status.tasks_cancelled + self.status.tasks_dead + unusable

    def check_env(self) -> None:
        """Raise `EnvCircuitOpen` once the run's env is circuit-broken (as last refreshed)."""
        why = self.status.broken_envs.get(self.config.env.name)
        if why is not None:
            raise EnvCircuitOpen.of(self.config, why)

    def _task(self, index: int, task_id: str, payload: dict, min_version: int) -> task_pb2.Task:
        cfg, sampling = self.config, self.config.rollout.sampling
        failures = cfg.rollout.failures
        task = task_pb2.Task(
            task_id=task_id,
            run_id=cfg.run_id,
            env=cfg.env.name,
            payload_json=json.dumps(payload),
            group_size=cfg.rollout.group_size,
            max_turns=cfg.rollout.max_turns,
            sampling=common_pb2.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_new_tokens,
                seed=task_seed(cfg.trainer.seed, index, cfg.rollout.group_size),
            ),
            scorer=cfg.scorer,
            scorer_options_json=json.dumps(cfg.scorer_options),
            model=cfg.policy_model,
            min_policy_version=min_version,
            created_at=time.time(),
            env_options_json=json.dumps(cfg.env.options),
            failures=task_pb2.EpisodeFailures(
                retries=failures.episode_retries,
                breaker_window=failures.breaker_window,
                breaker_failure_rate=failures.breaker_failure_rate,
            ),
        )
        tail = sampling.length_tail
        if tail is not None:
            draw = random.Random(f"{cfg.trainer.seed}-{index}").lognormvariate(
                math.log(tail.median), tail.sigma
            )
            task.sampling.max_new_tokens = max(1, min(sampling.max_new_tokens, round(draw)))
        with tracing.tracer().start_as_current_span(
            "trainer.feed_task", context=Context(), kind=SpanKind.PRODUCER
        ) as span:  # the root of this task's trace
            span.set_attributes({"treadle.run_id": cfg.run_id, "treadle.task_id": task_id})
            tracing.inject_proto(task.trace)
        return task

    async def cancel_unstarted(self, consumer: str) -> None:
        """Take every fed task no rollout replica has read yet (acked, counted cancelled)."""
        run = self.config.run_id
        tasks = names.tasks_stream(run)
        await streams.ensure_group(self.r, tasks, names.ROLLOUT_GROUP)
        while unread := await streams.read_group(
            self.r,
            [tasks],
            names.ROLLOUT_GROUP,
            consumer,
            task_pb2.Task,
            count=1000,
            block_ms=None,
        ):
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.xack(tasks, names.ROLLOUT_GROUP, *[entry for _, entry, _ in unread])
                pipe.hincrby(names.run_state(run), "tasks_cancelled", len(unread))
                await pipe.execute()

    async def in_flight(self) -> int:
        """Tasks rollout replicas read and have not finished."""
        pending = await self.r.xpending(names.tasks_stream(self.config.run_id), names.ROLLOUT_GROUP)
        return int(pending["pending"])
