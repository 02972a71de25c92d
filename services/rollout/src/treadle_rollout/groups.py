"""A task's group of episodes: started under its run's staleness bound (`admit`), and
played once the policy version the task demands is here (`play`), its episodes' env sessions
opened meanwhile; failed episodes are played again before the group is done (`failures.py`).

A task's episodes generate with at least its `min_policy_version` (they wait for it); the
version is the run's adapter's for a LoRA run (`policies.py`), else the engine's (`weight_sync.py`).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from treadle_common.fleet import admission
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.runtime import tracing
from treadle_rollout import metrics as rollout_metrics
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.failures import EpisodeRetries, GroupOutcome
from treadle_rollout.policies import RunPolicies
from treadle_rollout.weight_sync import WeightSync


class Groups:
    def __init__(
        self,
        r: aioredis.Redis,
        runner: EpisodeRunner,
        sync: WeightSync,
        policies: RunPolicies | None,
    ):
        self.r = r
        self.runner = runner
        self.sync = sync
        self.policies = policies
        self.admission_waits = 0
        """Times a group waited for a newer version before the bound let it start."""
        self.retries = EpisodeRetries(r)

    async def admit(self, task: task_pb2.Task) -> bool:
        """Wait until the run's staleness bound lets this group start; False: cancelled.

        A task's episodes generate with at least its `min_policy_version` (they wait for it),
        so that version, when the engine holds an older one, is what the bound is checked
        against: a sync run's next step is admitted before its weights arrive."""
        while True:
            version = max(self._version(task), task.min_policy_version)
            decision = await admission.admit(self.r, task.run_id, task.task_id, version)
            if decision.closed:
                return False
            if decision.admitted:
                return True
            self.admission_waits += 1
            rollout_metrics.ADMISSION_WAITS.inc()
            await self._wait_for_newer(task, version)

    async def play(self, task: task_pb2.Task) -> GroupOutcome:
        """The task's episodes, failed ones played again (`EpisodeRetries`). A task that
        demands a version the engine does not hold yet (a sync run's next step, fed while the
        trainer trains the step that publishes it) starts its episodes at once: they open
        their env sessions and render their prompts, then wait for that version before their
        first generation (`EpisodeRunner.run`'s gate)."""
        gate = None
        if self._version(task) < task.min_policy_version:
            gate = asyncio.ensure_future(self._weights(task))
        try:
            group = await asyncio.gather(
                *(self.runner.run(task, i, gate) for i in range(task.group_size))
            )
            return await self.retries.settle(task, group, lambda i: self.runner.run(task, i, gate))
        finally:
            if gate is not None and not gate.done():
                gate.cancel()

    def _version(self, task: task_pb2.Task) -> int:
        """The version of the task's policy this replica serves now."""
        return self.policies.version(task.model) if self.policies else self.sync.engine.version

    async def _weights(self, task: task_pb2.Task) -> None:
        with tracing.tracer().start_as_current_span("rollout.wait_for_weights"):
            if self.policies is not None and self.policies.is_adapter(task.model):
                await self.policies.ensure(task.model, task.min_policy_version)
            else:
                await self.sync.ensure_version(task.min_policy_version)

    async def _wait_for_newer(self, task: task_pb2.Task, version: int) -> None:
        if self.policies is not None and self.policies.is_adapter(task.model):
            await self.policies.get(task.model).wait_for_newer(version, timeout_s=2.0)
        else:
            await self.sync.wait_for_newer(version, timeout_s=2.0)
