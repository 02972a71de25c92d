"""Treadle's own scheduling code, driven in simulated time (imported, not re-implemented):

    admission      `treadle_common.fleet.admission`: the staleness bound every rollout
                   replica asks before it starts a group, its Lua script run by an in-process
                   Redis (fakeredis with Lua), one call per group as in a real fleet
    GroupBuffer    the trainer's group assembly (`treadle_trainer.public.GroupBuffer`)
    build_batch    the step's batch: the staleness bound, whole groups, the group advantages

A simulated trajectory is a real `Trajectory` message with placeholder tokens: a prompt token
and two generated ones, tagged with the versions that started and finished the episode, so
that the trainer's code measures its staleness as it would a real one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import fakeredis

from treadle_common import names
from treadle_common.config.recipe import TrainerConfig
from treadle_common.fleet import admission
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_trainer.public import Batch, Entry, Group, GroupBuffer, build_batch

RUN = "sim"


class Admission:
    """The run's admission state in an in-process Redis, through the fleet's own calls."""

    def __init__(self, groups_per_step: int, max_staleness: int, base_version: int = 0):
        self._loop = asyncio.new_event_loop()
        self.redis = self._run(self._connect())
        self._run(
            admission.configure(
                self.redis,
                RUN,
                groups_per_step=groups_per_step,
                max_staleness=max_staleness,
                base_version=base_version,
            )
        )

    @staticmethod
    async def _connect() -> fakeredis.FakeAsyncRedis:
        return fakeredis.FakeAsyncRedis()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run_until_complete(coro)

    def admit(self, task_id: str, version: int) -> admission.Decision:
        return self._run(admission.admit(self.redis, RUN, task_id, version))

    def unusable(self, groups: int) -> None:
        """Groups no step will train (the trainer's `groups_unusable`): their places free."""
        self._run(self.redis.hincrby(names.run_state(RUN), "groups_unusable", groups))

    def close(self) -> None:
        self._run(admission.close(self.redis, RUN))

    def refused(self) -> int:
        value = self._run(self.redis.hget(names.run_state(RUN), "admission_refused"))
        return int(value or 0)

    def shutdown(self) -> None:
        self._run(self.redis.aclose())
        self._loop.close()


def trajectory(
    task_id: str, index: int, first_version: int, last_version: int, reward: float
) -> tpb.Trajectory:
    return tpb.Trajectory(
        trajectory_id=f"{task_id}/{index}",
        group_id=task_id,
        task_id=task_id,
        run_id=RUN,
        sample_index=index,
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -1.0, -1.0],
        token_versions=[-1, first_version, last_version],
        reward=reward,
        status=tpb.TRAJECTORY_STATUS_OK,
    )


class Groups:
    """Finished episodes into complete groups, in the order they complete (`GroupBuffer`)."""

    def __init__(self, group_size: int):
        self.buffer = GroupBuffer(group_size)

    def add(self, traj: tpb.Trajectory) -> None:
        self.buffer.add(Entry(traj.trajectory_id, traj))

    @property
    def ready(self) -> list[Group]:
        return self.buffer.ready


def step_batch(groups: list[Group], version: int, max_staleness: int, t: TrainerConfig) -> Batch:
    return build_batch(groups, version, max_staleness, t)
