"""Tasks given up on: to the run's dead-letter stream (treadle:{run}:dead) with why, acked
and counted in the run's state, in one transaction; the trainer feeds a task in each one's
place (a dead task that was admitted frees its place in the staleness bound).

A group with an episode that failed past its retries is given up on whole (`quarantined`):
its failed episodes go to the run's quarantine stream (treadle:{run}:quarantine) with their
status and error, its other episodes are discarded (counted), and its task is dead-lettered
(`episodes_failed`), all in the same transaction.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.clients import streams
from treadle_common.fleet import admission
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime import metrics
from treadle_common.runtime.logs import get_logger
from treadle_rollout.failures import status_name

log = get_logger(__name__)


async def give_up(
    r: aioredis.Redis,
    stream: str,
    entry_id: str,
    task: task_pb2.Task | streams.InvalidEntry,
    reason: str,
    deliveries: int,
    consumer: str,
    error: str | None = None,
    quarantined: list[tuple[tpb.Trajectory, int]] | None = None,
    discarded: int = 0,
) -> None:
    """Dead-letter a task of `stream` (its last error, when `error` is None, from the run's
    task errors), acked and counted (`tasks_dead`, `dead:{reason}`), at once; with it, in
    the same transaction, its `quarantined` episodes (each with how often it was played) and
    the count of its group's other episodes, `discarded`."""
    run = names.run_of(stream)
    if error is None:
        last = await r.hget(names.task_errors(run), entry_id)
        error = streams.text(last) if last is not None else ""
    fields: dict = {
        "entry_id": entry_id,
        "reason": reason,
        "error": error,
        "deliveries": deliveries,
        "consumer": consumer,
        "at": time.time(),
    }
    if isinstance(task, task_pb2.Task):
        fields |= {"task_id": task.task_id, names.STREAM_FIELD: task.SerializeToString()}
    admitted = isinstance(task, task_pb2.Task) and await r.hexists(
        admission.admitted_key(run), task.task_id
    )
    metrics.DROPPED.labels("rollout", "task", reason).inc()
    log.warning("task dead-lettered", entry=entry_id, reason=reason, error=error[:300])
    async with r.pipeline(transaction=True) as pipe:
        pipe.xadd(names.dead_letters(run), fields)
        pipe.hincrby(names.run_state(run), "tasks_dead", 1)
        pipe.hincrby(names.run_state(run), f"dead:{reason}", 1)
        if reason == "invalid":
            pipe.hincrby(names.run_state(run), "tasks_invalid", 1)
        if admitted:  # its place in the staleness bound goes to its replacement
            pipe.hincrby(names.run_state(run), "admission_released", 1)
        for traj, attempts in quarantined or []:
            pipe.xadd(names.quarantine(run), _quarantined(entry_id, traj, attempts))
            pipe.hincrby(names.run_state(run), "trajectories_quarantined", 1)
        if discarded:
            pipe.hincrby(names.run_state(run), "trajectories_discarded", discarded)
        pipe.hdel(names.task_errors(run), entry_id)
        pipe.xack(stream, names.ROLLOUT_GROUP, entry_id)
        await pipe.execute()


def _quarantined(entry_id: str, traj: tpb.Trajectory, attempts: int) -> dict:
    return {
        "trajectory_id": traj.trajectory_id,
        "task_id": traj.task_id,
        "task_entry_id": entry_id,
        "reason": status_name(traj),
        "error": traj.error,
        "attempts": attempts,
        "at": time.time(),
        names.STREAM_FIELD: traj.SerializeToString(),
    }
