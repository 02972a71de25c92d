"""Many runs, one fleet: what each active run needs from the shared services.

Every active run has a `RunPolicy` in Redis (`names.RUN_POLICIES`), written by its owner
before the run joins `names.RUNS_KEY`:

    run id -> policy  (the weight-store model its tasks name: the run's own versions)
              base    (the full-weight model rollout must hold: a replica serves a run's
                       tasks only if it serves this model)
              lora    (the policy is a LoRA adapter on `base`, served next to other runs'
                       adapters on one copy of the base)
              tenant, weight, priority (scheduling: `scheduling.py`)

A full-weight run's policy is its model (`base == policy`): it owns that model's weights, so
no other run may train it or an adapter on it at the same time (`conflict`). A LoRA run's
policy is `names.adapter_policy(base, run)`: any number of them share a base.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from treadle_common import names


class RunPolicy(BaseModel):
    """One active run as the fleet sees it."""

    run_id: str
    policy: str = Field(description="Weight-store model of the run's versions (tasks name it)")
    base: str = Field(description="Full-weight model a rollout replica must serve for it")
    lora: bool = Field(False, description="The policy is a LoRA adapter on `base`")
    tenant: str = Field("default", description="Who the run belongs to (from its token)")
    weight: float = Field(1.0, gt=0, description="Share of contended capacity (fair share)")
    priority: int = Field(0, description="Higher is served first when capacity is contended")


def conflict(new: RunPolicy, active: list[RunPolicy]) -> str | None:
    """Why `new` cannot run beside `active`, or None. A full-weight run changes its model's
    weights, so it needs that model to itself: no other full-weight run of it, and no LoRA
    run whose adapters apply to it."""
    for other in active:
        if other.run_id == new.run_id or other.base != new.base:
            continue
        if not (new.lora and other.lora):
            kind = "a LoRA run on" if other.lora else "a full-weight run of"
            return f"run {other.run_id} is {kind} {new.base}; a full-weight run needs it alone"
    return None


async def register(r: aioredis.Redis, policy: RunPolicy) -> None:
    await r.hset(names.RUN_POLICIES, policy.run_id, policy.model_dump_json())


async def unregister(r: aioredis.Redis, run_id: str) -> None:
    await r.hdel(names.RUN_POLICIES, run_id)


async def active(r: aioredis.Redis) -> dict[str, RunPolicy]:
    """Every registered run's policy (an entry that does not parse is skipped)."""
    out = {}
    for key, value in (await r.hgetall(names.RUN_POLICIES)).items():
        run = key.decode() if isinstance(key, bytes) else key
        try:
            out[run] = RunPolicy.model_validate(json.loads(value))
        except ValueError:
            continue
    return out


async def tenant_of(r: aioredis.Redis, run_id: str) -> str | None:
    """The tenant of a registered run (None: not registered)."""
    raw = await r.hget(names.RUN_POLICIES, run_id)
    return None if raw is None else RunPolicy.model_validate_json(raw).tenant
