"""Trainer service: owns runs (submitted over HTTP, resumed after a crash) and serves the
Tinker-style training API.

    /v1/runs...       see `runs_api.py` (the runs, their leases, orphan resume)
    /v1/training/...  see `training_api.py`

See `run/` for the dataflow of one run.
"""

from __future__ import annotations

import asyncio

import torch

from treadle_common.api.runs import TrainerInfo
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.logs import get_logger
from treadle_common.service import ServiceRuntime
from treadle_trainer import training_api
from treadle_trainer.run import SERVICE
from treadle_trainer.runs_api import Runs
from treadle_trainer.settings import TrainerSettings

log = get_logger(__name__)


async def main(settings: TrainerSettings) -> None:
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    store = WeightStoreClient(settings.weight_store_addr)
    env = EnvClient(settings.env_gateway_addr)
    runs: Runs | None = None
    stages = (
        runtime.progress.stage("trajectories", lambda: runs.collecting if runs else 0),
        runtime.progress.stage("step"),
    )
    runs = Runs(runtime, settings, store, env, stages)
    runtime.set_info(lambda: {"runs": runs.states() if runs else {}}, TrainerInfo)
    runs.mount(runtime.app)
    training_api.mount(runtime.app, store, settings.state_dir)
    resumer = asyncio.create_task(runs.resume_orphans())

    async def drain() -> None:
        resumer.cancel()
        if runs is not None:
            await runs.drain()

    runtime.on_drain(drain)
    await runtime.serve()
