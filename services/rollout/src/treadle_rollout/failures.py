"""Failed episodes: played again while their group waits, and what a group that keeps one is.

    group played --> failed members (env / sandbox / engine / reward error) played again,
        together, up to the task's `failures.retries` times, while the env's breaker is
        closed --> each episode's final outcome to the run's breaker (`fleet.breaker`)
    --> whole: committed (`worker.py`); with a member that still fails: quarantined whole
        (`TaskWorker._quarantine`, `dead_letters.give_up`), never trained on its survivors only

A retry plays the same episode (same sample index, so the same trajectory id and sampling
seed): a group's members stay exchangeable whatever failed, so its advantages are not biased
toward the episodes that happened to survive.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from treadle_common.fleet import breaker
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime.logs import get_logger
from treadle_rollout import metrics
from treadle_rollout.episodes import GATEWAY_UNREACHABLE

log = get_logger(__name__)
FAILED = frozenset(
    {
        tpb.TRAJECTORY_STATUS_ENV_ERROR,
        tpb.TRAJECTORY_STATUS_SANDBOX_ERROR,
        tpb.TRAJECTORY_STATUS_ENGINE_ERROR,
        tpb.TRAJECTORY_STATUS_REWARD_ERROR,
    }
)
"""Statuses of an episode that failed (infrastructure), as opposed to one that was scored."""
ENV_FAILURES = frozenset({tpb.TRAJECTORY_STATUS_ENV_ERROR, tpb.TRAJECTORY_STATUS_SANDBOX_ERROR})
"""The failures that count against the env in its circuit breaker: its own (it raised, its
sandbox failed), not an engine's or a scorer's, nor a gateway that did not answer (a
transient outage never ends a run)."""


def env_failed(traj: tpb.Trajectory) -> bool:
    """Whether the episode failed because of its env."""
    return traj.status in ENV_FAILURES and not traj.error.startswith(GATEWAY_UNREACHABLE)


RETRY_BACKOFF_S = 0.2
"""The first wait before a retry (jittered, doubling, at most 5 s)."""


def status_name(traj: tpb.Trajectory) -> str:
    return tpb.TrajectoryStatus.Name(traj.status).removeprefix("TRAJECTORY_STATUS_").lower()


@dataclass
class GroupOutcome:
    trajectories: list[tpb.Trajectory]
    attempts: list[int] = field(default_factory=list)
    """Per member: how often it was played."""

    @property
    def failed(self) -> list[int]:
        """The members that failed every attempt."""
        return [i for i, t in enumerate(self.trajectories) if t.status in FAILED]


class EpisodeRetries:
    def __init__(self, r: aioredis.Redis):
        self.r = r
        self.retried = 0
        """Episodes played again (every attempt after the first)."""

    async def settle(
        self,
        task: task_pb2.Task,
        group: list[tpb.Trajectory],
        replay: Callable[[int], Awaitable[tpb.Trajectory]],
    ) -> GroupOutcome:
        """`group` with its failed members played again (`replay(sample_index)`) up to the
        task's retries, each episode's final outcome recorded to the run's breaker."""
        outcome = GroupOutcome(list(group), [1] * len(group))
        retries = max(0, task.failures.retries)
        backoff = RETRY_BACKOFF_S
        for _ in range(retries):
            todo = outcome.failed
            if not todo or await breaker.why_open(self.r, task.run_id, task.env):
                break
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 5.0)
            for i in todo:
                last = outcome.trajectories[i]
                metrics.FAILED_EPISODE_RETRIES.labels(status_name(last)).inc()
                log.info(
                    "episode failed; playing it again",
                    task=task.task_id,
                    index=i,
                    status=status_name(last),
                    error=last.error[:300],
                )
            again = await asyncio.gather(*(replay(i) for i in todo))
            for i, traj in zip(todo, again, strict=True):
                outcome.trajectories[i] = traj
                outcome.attempts[i] += 1
                self.retried += 1
        await self._record(task, outcome)
        return outcome

    async def _record(self, task: task_pb2.Task, outcome: GroupOutcome) -> None:
        """The group's final outcomes into its env's breaker, in one call."""
        f = task.failures
        failed = [env_failed(t) for t in outcome.trajectories]
        last = next((t for t in reversed(outcome.trajectories) if env_failed(t)), None)
        why = await breaker.record(
            self.r,
            task.run_id,
            task.env,
            failed,
            f"{status_name(last)}: {last.error}" if last is not None else "",
            f.breaker_window,
            f.breaker_failure_rate,
        )
        if why is not None:
            metrics.BREAKERS_OPENED.inc()
            log.error("env circuit-broken for the run", run=task.run_id, env=task.env, why=why)
