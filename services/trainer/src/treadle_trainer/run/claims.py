"""What a run claims of the fleet: its model, a place in its tenant's quota, its visibility.

    POST /v1/runs --> quota (the tenant's active runs, `trainer_tenant_max_runs`: 429)
                  --> claim_model: register the run's `fleet.RunPolicy`, then check it
                      against every active run's (`fleet.conflict`: 409) and withdraw it
                      if it conflicts

Registered first and checked after, so of two conflicting runs started at once neither slips
through. A policy counts while its run runs or is starting (an owner holds its lease); one
left by a run that does neither is stale and ignored.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import Backlog, RunStatus, Usage
from treadle_common.auth import policy as auth
from treadle_common.clients import streams
from treadle_common.clients.weights import WeightStoreClient, build_manifest, chunk_positions
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import admission
from treadle_common.fleet import runs as fleet
from treadle_trainer import errors


def policy_of(config: RunConfig, tenant: str = auth.DEFAULT_TENANT) -> fleet.RunPolicy:
    """What the fleet must serve for `config`."""
    return fleet.RunPolicy(
        run_id=config.run_id,
        policy=config.policy_model,
        base=config.model.name,
        lora=config.trainer.lora is not None,
        tenant=tenant,
        weight=config.scheduling.weight,
        priority=config.scheduling.priority,
    )


async def active_policies(r: aioredis.Redis) -> list[fleet.RunPolicy]:
    live = {streams.text(m) for m in await r.smembers(names.RUNS_KEY)}
    return [
        p
        for run, p in (await fleet.active(r)).items()
        if run in live or await r.exists(names.run_owner(run))
    ]


async def over_quota(r: aioredis.Redis, tenant: str, max_runs: int) -> str | None:
    """Why `tenant` may start no more runs now, or None (`max_runs` 0: no limit)."""
    if not max_runs:
        return None
    mine = [p for p in await active_policies(r) if p.tenant == tenant]
    if len(mine) < max_runs:
        return None
    return f"quota runs: tenant {tenant!r} has {len(mine)} active runs, the most it may"


async def claim_model(r: aioredis.Redis, config: RunConfig, tenant: str) -> str | None:
    """Register the run's policy unless it conflicts with an active run's (a full-weight run
    needs its model alone): why not, or None."""
    policy = policy_of(config, tenant)
    await fleet.register(r, policy)
    others = [p for p in await active_policies(r) if p.run_id != config.run_id]
    if (why := fleet.conflict(policy, others)) is not None:
        await fleet.unregister(r, config.run_id)
    return why


def visible(status: RunStatus, who: auth.Identity) -> RunStatus:
    """`status`, unless the caller's tenant may not see it (403, naming nothing of the run but
    its id)."""
    if not who.may_see(status.tenant):
        raise errors.Forbidden(f"run {status.run_id} belongs to another tenant")
    return status


async def backlog(r: aioredis.Redis) -> Backlog:
    """Work waiting in Redis for the active runs, and the tasks by the model they need."""
    active = [streams.text(m) for m in await r.smembers(names.RUNS_KEY)]
    tasks = [
        await streams.backlog(r, names.tasks_stream(run), names.ROLLOUT_GROUP) for run in active
    ]
    trajectories = [
        await streams.backlog(r, names.trajectories_stream(run), names.TRAINER_GROUP)
        for run in active
    ]
    policies = await fleet.active(r)
    by_model: dict[str, int] = {}
    for run, waiting in zip(active, tasks, strict=True):
        model = policies[run].base if run in policies else ""
        by_model[model] = by_model.get(model, 0) + waiting
    return Backlog(
        runs=len(active),
        tasks_waiting=sum(tasks),
        trajectories_waiting=sum(trajectories),
        tasks_by_model=by_model,
    )


def usage_by_tenant(runs: list[RunStatus], who: auth.Identity) -> dict[str, Usage]:
    """The runs' usage summed by tenant, for the tenants `who` may see."""
    out: dict[str, Usage] = {}
    for run in runs:
        if who.may_see(run.tenant):
            out[run.tenant] = out.get(run.tenant, Usage()) + run.usage
    return out


async def base_change_refused(
    r: aioredis.Redis, store: WeightStoreClient, model: str, raw: dict, me: str = ""
) -> str | None:
    """Why full weights `raw` may not be published as `model` now, or None: other than its
    newest version's while active runs (but `me`) train on it (LoRA runs' adapters apply to
    those weights; a full-weight run owns them), rollout would swap every run's base under
    them. The same weights again (an untrained session's, a run's unchanged base) pass."""
    users = sorted(p.run_id for p in await active_policies(r) if p.base == model and p.run_id != me)
    if not users:
        return None
    versions = await store.list_versions(model)
    if not versions:  # none yet: the first publish sets the base (rollout checks adapters)
        return None
    latest = await store.get_manifest(model, versions[-1].version)
    if chunk_positions(latest) == chunk_positions(build_manifest(model, raw)[0]):
        return None
    return (
        f"model {model} is the base of active runs {users}: other weights published under "
        "its name would change theirs; use another model name"
    )


async def join(
    r: aioredis.Redis, config: RunConfig, tenant: str, base_version: int, max_staleness: int
) -> None:
    """The run among the fleet's active runs: its admission (groups per step, staleness,
    the version its steps count from) and its policy, both before rollout sees it."""
    await admission.configure(
        r,
        config.run_id,
        groups_per_step=config.trainer.tasks_per_step,
        max_staleness=max_staleness,
        base_version=base_version,
    )
    await fleet.register(r, policy_of(config, tenant))
    await r.sadd(names.RUNS_KEY, config.run_id)
