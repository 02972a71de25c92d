"""Trainer service: owns runs (submitted over HTTP, resumed after a crash) and serves the
Tinker-style training API.

    POST /v1/runs (a recipe as JSON) --> lease treadle:{run}:owner --> RunOwner.execute
    GET  /v1/runs/{id}                 status, steps, counters, drops by reason
    POST /v1/runs/{id}/evaluations     the client evaluated a step: a sync run held there goes on
    on start: every active run in Redis whose owner lease lapsed is restored and resumed
    /v1/training/...                   see `training_api.py`

See `run.py` for the dataflow of one run.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import HTTPException, Query

from treadle_common import names
from treadle_common.api.runs import Backlog, EvaluationDone, RunStatus, TrainerInfo
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config import RunConfig
from treadle_common.logs import get_logger
from treadle_common.service import ServiceRuntime
from treadle_common.settings import Settings
from treadle_trainer import training_api
from treadle_trainer.run import SERVICE, RunOwner

log = get_logger(__name__)


async def main(settings: Settings) -> None:
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    store = WeightStoreClient(settings.weight_store_addr)
    env = EnvClient(settings.env_gateway_addr)
    runs: dict[str, RunOwner] = {}
    tasks: set[asyncio.Task] = set()
    lease_ms = int(settings.trainer_lease_s * 1000)
    runtime.set_info(
        lambda: {"runs": {rid: o.status.state for rid, o in runs.items()}}, TrainerInfo
    )
    stages = (
        runtime.progress.stage("trajectories", lambda: sum(o.collecting for o in runs.values())),
        runtime.progress.stage("step"),
    )

    async def own(owner: RunOwner) -> None:
        """Hold the run's lease while its owner executes it."""
        key = names.run_owner(owner.config.run_id)
        work = asyncio.create_task(owner.execute())
        while not work.done():
            await runtime.redis.set(key, settings.instance, px=lease_ms)
            await asyncio.wait([work], timeout=settings.trainer_lease_s / 3)
        await runtime.redis.delete(key)

    def launch(config: RunConfig) -> None:
        owner = RunOwner(config, runtime.redis, store, env, stages=stages)
        runs[config.run_id] = owner
        task = asyncio.create_task(own(owner))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def resume_orphans() -> None:
        """Take over active runs whose owner died (its lease expired), until we stop."""
        while not runtime.draining:
            for member in await runtime.redis.smembers(names.RUNS_KEY):
                run = member.decode()
                if run in runs:
                    continue
                raw = await runtime.redis.get(names.run_config(run))
                if raw is None:
                    continue
                if not await runtime.redis.set(
                    names.run_owner(run), settings.instance, px=lease_ms, nx=True
                ):
                    continue
                log.info("resuming run", run=run)
                launch(RunConfig.model_validate_json(raw))
            await asyncio.sleep(1.0)

    @runtime.app.post("/v1/runs", status_code=202, tags=["runs"])
    async def start_run(config: RunConfig) -> RunStatus:
        if runtime.draining:
            raise HTTPException(503, "trainer is draining")
        if config.run_id in runs:
            raise HTTPException(409, f"run {config.run_id} already exists")
        if await runtime.redis.exists(
            names.tasks_stream(config.run_id),
            names.trajectories_stream(config.run_id),
            names.run_config(config.run_id),
        ):
            raise HTTPException(
                409, f"run {config.run_id} already has state in Redis; use a new run_id"
            )
        await runtime.redis.set(names.run_owner(config.run_id), settings.instance, px=lease_ms)
        launch(config)
        return runs[config.run_id].status

    @runtime.app.get("/v1/backlog", tags=["runs"])
    async def backlog() -> Backlog:
        """Work waiting in Redis for the active runs (KEDA scales rollout on `tasks_waiting`)."""
        r = runtime.redis
        active = [m.decode() for m in await r.smembers(names.RUNS_KEY)]
        return Backlog(
            runs=len(active),
            tasks_waiting=sum(
                [
                    await streams.backlog(r, names.tasks_stream(run), names.ROLLOUT_GROUP)
                    for run in active
                ]
            ),
            trajectories_waiting=sum(
                [
                    await streams.backlog(r, names.trajectories_stream(run), names.TRAINER_GROUP)
                    for run in active
                ]
            ),
        )

    @runtime.app.get("/v1/runs", tags=["runs"])
    async def list_runs() -> list[RunStatus]:
        return [o.status for o in runs.values()]

    @runtime.app.get("/v1/runs/{run_id}", tags=["runs"])
    async def get_run(
        run_id: str,
        steps_from: int = Query(
            0,
            ge=0,
            description="Only the step records from this index on (a polling client "
            "asks for the ones it has not seen: the answer stays small in a long run)",
        ),
    ) -> RunStatus:
        if run_id not in runs:
            raise HTTPException(404, f"no run {run_id}")
        status = runs[run_id].status
        if not steps_from:
            return status
        return status.model_copy(update={"steps": status.steps[steps_from:]})

    @runtime.app.post("/v1/runs/{run_id}/evaluations", tags=["runs"])
    async def evaluated(run_id: str, report: EvaluationDone) -> RunStatus:
        """The client evaluated the weights of `step`: a sync run holding there goes on."""
        if run_id not in runs:
            raise HTTPException(404, f"no run {run_id}")
        await runs[run_id].mark_evaluated(report.step)
        return runs[run_id].status

    training_api.mount(runtime.app, store, settings.state_dir)
    resumer = asyncio.create_task(resume_orphans())

    async def drain() -> None:
        resumer.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    runtime.on_drain(drain)
    await runtime.serve()
