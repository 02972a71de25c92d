"""Trainer service: accepts runs over HTTP and owns them until they finish.

    POST /v1/runs (a recipe as JSON) --> RunOwner.execute (background) --> GET /v1/runs/{id}

See `run.py` for the dataflow of one run.
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException

from treadle_common import names
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config import RunConfig
from treadle_common.service import ServiceRuntime
from treadle_common.settings import Settings
from treadle_trainer.run import SERVICE, RunOwner, RunStatus


async def main(settings: Settings) -> None:
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    store = WeightStoreClient(settings.weight_store_addr)
    env = EnvClient(settings.env_gateway_addr)
    runs: dict[str, RunOwner] = {}
    tasks: set[asyncio.Task] = set()
    runtime.set_info(lambda: {"runs": {rid: o.status.state for rid, o in runs.items()}})

    @runtime.app.post("/v1/runs", status_code=202, tags=["runs"])
    async def start_run(config: RunConfig) -> RunStatus:
        if runtime.draining:
            raise HTTPException(503, "trainer is draining")
        if config.run_id in runs:
            raise HTTPException(409, f"run {config.run_id} already exists")
        if await runtime.redis.exists(
            names.tasks_stream(config.run_id), names.trajectories_stream(config.run_id)
        ):
            raise HTTPException(
                409, f"run {config.run_id} already has state in Redis; use a new run_id"
            )
        owner = RunOwner(config, runtime.redis, store, env, consumer=settings.instance)
        runs[config.run_id] = owner
        task = asyncio.create_task(owner.execute())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return owner.status

    @runtime.app.get("/v1/runs", tags=["runs"])
    async def list_runs() -> list[RunStatus]:
        return [o.status for o in runs.values()]

    @runtime.app.get("/v1/runs/{run_id}", tags=["runs"])
    async def get_run(run_id: str) -> RunStatus:
        if run_id not in runs:
            raise HTTPException(404, f"no run {run_id}")
        return runs[run_id].status

    async def drain() -> None:
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    runtime.on_drain(drain)
    await runtime.serve()
