"""The trainer's run API and the runs it owns.

    POST /v1/runs (a recipe as JSON) --> lease treadle:{run}:owner --> RunOwner.execute
    GET  /v1/runs, /v1/runs/{id}      status, steps (from `steps_from`), counters, drops
    POST /v1/runs/{id}/evaluations    the client evaluated a step: a sync run held there goes on
    GET  /v1/backlog                  work waiting in Redis (KEDA scales rollout on it)

A run is owned by one trainer at a time: the owner renews `treadle:{run}:owner` while it
executes the run. Every second each trainer looks for active runs whose lease lapsed (their
owner died) and resumes them from their last checkpoint.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, HTTPException, Query

from treadle_common import names
from treadle_common.api.runs import Backlog, EvaluationDone, RunStatus
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config import RunConfig
from treadle_common.logs import get_logger
from treadle_common.progress import Stage
from treadle_common.service import ServiceRuntime
from treadle_trainer.run import RunOwner
from treadle_trainer.settings import TrainerSettings

log = get_logger(__name__)


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
        self._tasks: set[asyncio.Task] = set()
        self._lease_ms = int(settings.trainer_lease_s * 1000)

    @property
    def collecting(self) -> int:
        return sum(o.collecting for o in self.owners.values())

    def states(self) -> dict[str, str]:
        return {rid: o.status.state for rid, o in self.owners.items()}

    def _owner(self, run_id: str) -> RunOwner:
        if run_id not in self.owners:
            raise HTTPException(404, f"no run {run_id}")
        return self.owners[run_id]

    async def _own(self, owner: RunOwner) -> None:
        """Hold the run's lease while its owner executes it."""
        key = names.run_owner(owner.config.run_id)
        work = asyncio.create_task(owner.execute())
        redis = self.runtime.redis
        while not work.done():
            await redis.set(key, self.settings.instance, px=self._lease_ms)
            await asyncio.wait([work], timeout=self.settings.trainer_lease_s / 3)
        await redis.delete(key)

    def _launch(self, config: RunConfig) -> None:
        owner = RunOwner(config, self.runtime.redis, self.store, self.env, stages=self.stages)
        self.owners[config.run_id] = owner
        task = asyncio.create_task(self._own(owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resume_orphans(self) -> None:
        """Take over active runs whose owner died (its lease expired), until we stop."""
        redis = self.runtime.redis
        while not self.runtime.draining:
            for member in await redis.smembers(names.RUNS_KEY):
                run = streams.text(member)
                if run in self.owners:
                    continue
                raw = await redis.get(names.run_config(run))
                if raw is None:
                    continue
                if not await redis.set(
                    names.run_owner(run), self.settings.instance, px=self._lease_ms, nx=True
                ):
                    continue
                log.info("resuming run", run=run)
                self._launch(RunConfig.model_validate_json(raw))
            await asyncio.sleep(1.0)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def start(self, config: RunConfig) -> RunStatus:
        if self.runtime.draining:
            raise HTTPException(503, "trainer is draining")
        if config.run_id in self.owners:
            raise HTTPException(409, f"run {config.run_id} already exists")
        redis = self.runtime.redis
        if await redis.exists(
            names.tasks_stream(config.run_id),
            names.trajectories_stream(config.run_id),
            names.run_config(config.run_id),
        ):
            raise HTTPException(
                409, f"run {config.run_id} already has state in Redis; use a new run_id"
            )
        await redis.set(names.run_owner(config.run_id), self.settings.instance, px=self._lease_ms)
        self._launch(config)
        return self.owners[config.run_id].status

    async def backlog(self) -> Backlog:
        r = self.runtime.redis
        active = [streams.text(m) for m in await r.smembers(names.RUNS_KEY)]
        tasks = [
            await streams.backlog(r, names.tasks_stream(run), names.ROLLOUT_GROUP) for run in active
        ]
        trajectories = [
            await streams.backlog(r, names.trajectories_stream(run), names.TRAINER_GROUP)
            for run in active
        ]
        return Backlog(
            runs=len(active), tasks_waiting=sum(tasks), trajectories_waiting=sum(trajectories)
        )

    def mount(self, app: FastAPI) -> None:
        app.post("/v1/runs", status_code=202, tags=["runs"])(self.start)

        @app.get("/v1/backlog", tags=["runs"])
        async def backlog() -> Backlog:
            """Work waiting in Redis for the active runs (KEDA scales rollout on
            `tasks_waiting`)."""
            return await self.backlog()

        @app.get("/v1/runs", tags=["runs"])
        async def list_runs() -> list[RunStatus]:
            return [o.status for o in self.owners.values()]

        @app.get("/v1/runs/{run_id}", tags=["runs"])
        async def get_run(
            run_id: str,
            steps_from: int = Query(
                0,
                ge=0,
                description="Only the step records from this index on (a polling client "
                "asks for the ones it has not seen: the answer stays small in a long run)",
            ),
        ) -> RunStatus:
            status = self._owner(run_id).status
            if not steps_from:
                return status
            return status.model_copy(update={"steps": status.steps[steps_from:]})

        @app.post("/v1/runs/{run_id}/evaluations", tags=["runs"])
        async def evaluated(run_id: str, report: EvaluationDone) -> RunStatus:
            """The client evaluated the weights of `step`: a sync run holding there goes on."""
            owner = self._owner(run_id)
            await owner.holds.mark_evaluated(report.step)
            return owner.status
