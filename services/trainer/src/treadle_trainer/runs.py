"""The runs this trainer owns, and the run API's core (its HTTP edge: `http.py`).

    POST /v1/runs (a recipe as JSON) --> lease treadle:{run}:owner --> the tenant's quota and
         the run's model claimed (`run/claims.py`: 429, 409) --> RunOwner.execute
    GET  /v1/runs, /v1/runs/{id}      status, steps (from `steps_from`), counters, drops: the
                                      caller's tenant's runs only (admin: all; else 403)
    POST /v1/runs/{id}/evaluations    the client evaluated a step: a sync run held there goes on
    GET  /v1/backlog                  work waiting in Redis, by model (KEDA scales rollout on it)

Runs share this process's torch thread through one scheduling policy (`turns`: priority,
then weighted fair share of step seconds, paced by weighted steps;
`treadle_common.fleet.scheduling`).

A run is owned by one trainer at a time, through a fenced lease (`run/lease.py`): created
with SET NX, renewed by compare-and-PEXPIRE while the owner executes the run; an owner whose
renewal finds another trainer's lease stops at once (`lost`), and the ledger refuses its
commits even before it notices. Every second each trainer looks for active runs whose lease
lapsed (their owner died) and resumes them from their last checkpoint. A trainer shutting
down (SIGTERM) hands its runs off: each stops at its next step boundary, checkpoints and
releases its lease, so another trainer resumes it within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from treadle_common import names
from treadle_common.api.runs import (
    EvaluationDone,
    RunState,
    RunStatus,
)
from treadle_common.auth import policy as auth
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import runs as fleet
from treadle_common.fleet import scheduling
from treadle_common.runtime import metrics
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_common.runtime.service import ServiceRuntime
from treadle_trainer import errors
from treadle_trainer.paths import check_config
from treadle_trainer.run import RunOwner, claims
from treadle_trainer.run.lease import Lease
from treadle_trainer.settings import TrainerSettings

log = get_logger(__name__)
MOVED: tuple[RunState, ...] = ("handed_off", "lost")
"""A local owner in these states no longer runs the run: another trainer does."""


class Runs:
    def __init__(
        self,
        runtime: ServiceRuntime,
        settings: TrainerSettings,
        store: WeightStoreClient,
        env: EnvClient,
        stages: tuple[Stage, Stage],
    ):
        self.runtime, self.settings, self.store, self.env = runtime, settings, store, env
        self.stages = stages
        self.owners: dict[str, RunOwner] = {}
        self._executing: set[str] = set()
        """Runs an owner of ours is executing: never orphans, whatever state it reports (an
        ending run reports its final state before it leaves the active runs)."""
        self._tasks: set[asyncio.Task] = set()
        self._lease_ms = int(settings.trainer_lease_s * 1000)
        self.turns = scheduling.turns_for(
            settings.scheduling_policy, settings.trainer_torch_lanes, settings.trainer_pace_lead
        )
        """Whose step gets a torch lane next, when more runs' steps wait than there are."""

    @property
    def collecting(self) -> int:
        return sum(o.collecting for o in self.owners.values())

    def states(self) -> dict[str, str]:
        return {rid: o.status.state for rid, o in self.owners.items()}

    def _owner(self, run_id: str, who: auth.Identity = auth.ANONYMOUS) -> RunOwner:
        if run_id not in self.owners:
            raise errors.NotFound(f"no run {run_id}")
        owner = self.owners[run_id]
        claims.visible(owner.status, who)
        return owner

    def _lease(self, run_id: str) -> Lease:
        return Lease(self.runtime.redis, run_id, self.settings.instance, self._lease_ms)

    async def _own(self, owner: RunOwner) -> None:
        """Hold the run while it executes; after an infrastructure error, resume it from its
        last checkpoint with a new owner (backoff with jitter, `trainer_run_retries` times)."""
        lease, run = owner.lease, owner.config.run_id
        retries = self.settings.trainer_run_retries
        for attempt in range(retries + 1):
            await self._hold(owner, last_attempt=attempt == retries)
            if owner.status.state != "retrying":
                break
            delay = min(30.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("run resumes", run=run, attempt=attempt + 1, delay_s=round(delay, 2))
            if not await self._wait_holding(lease, delay):
                owner.status.state = "lost"
                break
            owner = self._owner_for(owner.config, lease, owner.status.tenant)
            self.owners[run] = owner
        try:
            await lease.release()
        except Exception as exc:
            log.warning("lease release failed", run=run, error=repr(exc))

    async def _wait_holding(self, lease: Lease, delay_s: float) -> bool:
        """Sleep `delay_s` renewing the lease; False once another trainer holds it."""
        deadline = time.monotonic() + delay_s
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, self.settings.trainer_lease_s / 3))
            with contextlib.suppress(Exception):  # Redis away: the lease may still hold
                if not await lease.renew() and (await lease.taken() or not await lease.acquire()):
                    return False  # another trainer has it
        return True

    async def _hold(self, owner: RunOwner, last_attempt: bool) -> None:
        """Renew the run's lease while its owner executes it; stop the owner if another
        trainer holds it. A Redis error skips a renewal (the lease outlives two of them)."""
        lease = owner.lease
        self._executing.add(owner.config.run_id)
        work = asyncio.create_task(owner.execute(last_attempt))
        work.add_done_callback(lambda _: self._executing.discard(owner.config.run_id))
        while not work.done():
            await asyncio.wait([work], timeout=self.settings.trainer_lease_s / 3)
            if work.done():
                break
            try:
                renewed = await lease.renew()
            except Exception as exc:
                log.warning("lease renewal failed", run=owner.config.run_id, error=repr(exc))
                continue
            if not renewed:
                log.warning("run lease taken over; stopping", run=owner.config.run_id)
                owner.lost = True
                work.cancel()
                await asyncio.wait([work])

    def _owner_for(self, config: RunConfig, lease: Lease, tenant: str) -> RunOwner:
        return RunOwner(
            config,
            self.runtime.redis,
            self.store,
            self.env,
            lease,
            stages=self.stages,
            retention_s=self.settings.trainer_run_retention_s,
            turns=self.turns,
            tenant=tenant,
            publish_worker=self.settings.trainer_publish_worker,
        )

    def _launch(self, config: RunConfig, lease: Lease, tenant: str) -> None:
        owner = self._owner_for(config, lease, tenant)
        self.owners[config.run_id] = owner
        task = asyncio.create_task(self._own(owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resume_orphans(self) -> None:
        """Take over active runs whose owner died (its lease expired), until we stop."""
        while not self.runtime.draining:
            try:
                await self._resume_orphans()
            except Exception as exc:  # Redis away: try again in a second
                log.warning("looking for orphaned runs failed", error=repr(exc))
            await asyncio.sleep(1.0)

    async def _resume_orphans(self) -> None:
        redis = self.runtime.redis
        for member in await redis.smembers(names.RUNS_KEY):
            run = streams.text(member)
            if run in self._executing:
                continue  # ours, executing (an ending one has not left the active runs yet)
            if run in self.owners and self.owners[run].status.state in (
                "pending",
                "running",
                "retrying",
            ):
                continue  # ours (a handed-off or lost one may come back to us)
            held = await redis.get(names.run_owner(run))
            mine = held is not None and streams.text(held).startswith(f"{self.settings.instance}#")
            if held is not None and not mine:
                continue  # another trainer's, alive
            raw = await redis.get(names.run_config(run))
            if raw is None:
                continue
            lease = self._lease(run)
            if not await (lease.reclaim_own() if mine else lease.acquire()):
                continue
            try:  # Redis is not trusted more than a caller: the same checks as a start
                config = RunConfig.model_validate_json(raw)
                check_config(config, self.settings.path_roots())
            except (ValueError, errors.ServiceError) as exc:
                why = str(exc)[:300]
                log.error("refusing to resume run: its stored config fails", run=run, why=why)
                metrics.DROPPED.labels("trainer", "run", "invalid_stored_config").inc()
                await lease.release()
                continue
            log.info("resuming run", run=run)
            policy = (await fleet.active(redis)).get(run)
            tenant = policy.tenant if policy is not None else auth.DEFAULT_TENANT
            self._launch(config, lease, tenant)

    async def drain(self) -> None:
        """Hand every run off at its next step boundary (checkpointed, lease released)."""
        for owner in self.owners.values():
            owner.hand_off()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def start(self, config: RunConfig, tenant: str) -> RunStatus:
        """Start a run owned by `tenant` (429 past the tenant's run quota)."""
        if self.runtime.draining:
            raise errors.Unavailable("trainer is draining")
        check_config(config, self.settings.path_roots())
        if config.run_id in self.owners:
            raise errors.Conflict(f"run {config.run_id} already exists")
        redis = self.runtime.redis
        lease = self._lease(config.run_id)
        if not await lease.acquire():  # SET NX: of two concurrent creates, one wins
            raise errors.Conflict(f"run {config.run_id} is owned by another trainer")
        if await redis.exists(
            names.tasks_stream(config.run_id),
            names.trajectories_stream(config.run_id),
            names.run_config(config.run_id),
        ):
            await lease.release()
            raise errors.Conflict(
                f"run {config.run_id} already has state in Redis; use a new run_id"
            )
        max_runs = self.settings.trainer_tenant_max_runs
        if (why := await claims.over_quota(redis, tenant, max_runs)) is not None:
            await lease.release()
            raise errors.TooManyRequests(why)
        if (why := await claims.claim_model(redis, config, tenant)) is not None:
            await lease.release()
            raise errors.Conflict(why)
        self._launch(config, lease, tenant)
        return self.owners[config.run_id].status

    def status(self, run_id: str, steps_from: int, who: auth.Identity) -> RunStatus | None:
        """The run's status from memory if this trainer runs it (None: ask Redis)."""
        owner = self.owners.get(run_id)
        if owner is None or owner.status.state in MOVED:
            return None
        status = claims.visible(owner.status, who)
        if not steps_from:
            return status
        return status.model_copy(update={"steps": status.steps[steps_from:]})

    async def evaluated(self, run_id: str, done: EvaluationDone, who: auth.Identity) -> RunStatus:
        """The client evaluated the weights of `done.step`: a sync run holding there goes on;
        the run's trackers record what it scored."""
        owner = self._owner(run_id, who)
        if owner.status.state in MOVED:
            raise errors.Conflict(f"run {run_id} moved to another trainer")
        await owner.holds.mark_evaluated(done.step)
        if done.mean_reward is not None:
            owner.tracking.evaluation(done.step, done.mean_reward, done.num_tasks)
        return owner.status
