"""The control plane's load: what a simulated run's traffic costs Redis, NATS and the
trainer's ingest, at the per-unit costs `treadle bench capacity` measured (`Infra`).

    redis    every group: its task's XADD, read and ack, its trajectories' Lua commit, the
             trainer's read and ack of them (one run's streams live on one instance; the
             runs of a fleet spread over `redis_shards`)
    nats     every group: one reward request of its answers and the reply
    ingest   every trajectory the trainer reads: decode, group assembly, the batch (in one
             process today: `ingest_processes`)

Each is the CPU seconds the run's traffic needs over the seconds it had (wall x cores).
Reported, not simulated: the run is not slowed by it, so a figure past 1 says the real run
would have queued there, and from 0.9 the component is the fleet's limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle_sim.scenario import Costs

if TYPE_CHECKING:
    from treadle_sim.engine import Outcome


def _seconds(costs: Costs, groups: int, trajectories: int, kib: float) -> float:
    return groups * costs.s_per_task + trajectories * costs.s_per_trajectory + kib * costs.s_per_kib


def utilisation(out: Outcome) -> dict[str, float]:
    infra, wall = out.infra, out.wall_s or 1.0
    traj_kib = (
        out.prompt_tokens * infra.trajectory_bytes_per_prompt_token
        + out.generated_tokens * infra.trajectory_bytes_per_generated_token
    ) / 1024
    answer_kib = out.generated_tokens * infra.answer_bytes_per_token / 1024
    n, trajs = out.groups, out.trajectories
    return {
        "redis_utilisation": round(
            _seconds(infra.redis, n, trajs, traj_kib) / (wall * infra.redis_shards), 4
        ),
        "nats_utilisation": round(
            _seconds(infra.nats, n, trajs, answer_kib) / (wall * infra.nats_cores), 4
        ),
        "ingest_utilisation": round(
            _seconds(infra.ingest, n, trajs, traj_kib) / (wall * infra.ingest_processes), 4
        ),
    }
