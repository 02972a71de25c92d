"""Usage accounting on rollout's side: what each run's episodes used, counted in the run's
state hash (`usage:<field>`, read into `RunStatus.usage` by the run's owner) and in
Prometheus by tenant (`treadle_rollout_tenant_usage_total`: tenants are few; runs are many,
so per run only through the run API).

Counted after a task's trajectories are committed, not in the same transaction: a replica that
dies between the two under-counts that one task (accounting, not delivery).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import USAGE_PREFIX
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import metrics


def of_group(group: list[tpb.Trajectory]) -> dict[str, float]:
    generated = sum(sum(t.loss_mask) for t in group)
    return {
        "prompt_tokens": sum(len(t.tokens) for t in group) - generated,
        "generated_tokens": generated,
        "episodes": len(group),
        "reward_calls": sum(t.timings.reward_s > 0 for t in group),
        "env_s": sum(t.timings.env_s for t in group),
        "sandbox_runs": sum(t.sandbox_runs for t in group),
    }


async def record(r: aioredis.Redis, run: str, tenant: str, counts: dict[str, float]) -> None:
    async with r.pipeline(transaction=False) as pipe:
        for kind, amount in counts.items():
            if kind == "env_s":
                pipe.hincrbyfloat(names.run_state(run), USAGE_PREFIX + kind, amount)
            else:
                pipe.hincrby(names.run_state(run), USAGE_PREFIX + kind, int(amount))
            metrics.TENANT_USAGE.labels(tenant, kind).inc(amount)
        await pipe.execute()
