"""Trainer service: owns runs (submitted over HTTP, resumed after a crash) and serves the
Tinker-style training API.

    /v1/runs...       see `runs_api.py` (the runs, their leases, orphan resume)
    /v1/training/...  see `training_api.py`

See `run/` for the dataflow of one run.
"""

from __future__ import annotations

import torch

from treadle_common.api.runs import TrainerInfo
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.logs import get_logger
from treadle_common.service import Service, ServiceRuntime
from treadle_trainer import training_api
from treadle_trainer.run import SERVICE
from treadle_trainer.runs_api import Runs
from treadle_trainer.settings import TrainerSettings

log = get_logger(__name__)


async def build(settings: TrainerSettings) -> Service:
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    store = WeightStoreClient(settings.weight_store_addr)
    env = EnvClient(settings.env_gateway_addr)
    trajectories = runtime.progress.stage("trajectories")
    runs = Runs(
        runtime, settings, store, env, (trajectories, runtime.progress.stage("step", liveness=True))
    )
    trajectories.pending = lambda: runs.collecting
    runtime.set_info(lambda: {"runs": runs.states()}, TrainerInfo)
    runs.mount(runtime.app)
    training_api.mount(runtime.app, store, settings.state_dir)
    runtime.on_drain(runs.drain)
    return Service(runtime, loops=[runs.resume_orphans])
