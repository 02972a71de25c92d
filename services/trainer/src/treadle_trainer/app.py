"""Trainer service: owns runs (submitted over HTTP, resumed after a crash) and serves the
Tinker-style training API.

    /v1/runs...       the runs (`runs.py`: their leases, orphan resume; routes: `http.py`)
    /v1/training/...  caller-owned training sessions (`training/`)
    /api/v1/...       the Tinker SDK's API, LoRA clients on shared base models (`tinker/`)

See `run/` for the dataflow of one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable

import torch

from treadle_common.api.runs import TrainerInfo
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.service import Service, ServiceRuntime
from treadle_trainer import http
from treadle_trainer.backends import set_torch_lanes
from treadle_trainer.run import SERVICE
from treadle_trainer.runs import Runs
from treadle_trainer.settings import TrainerSettings
from treadle_trainer.tinker.sampling import RolloutSampler
from treadle_trainer.tinker.state import TinkerState
from treadle_trainer.training.sessions import TrainingSessions

log = get_logger(__name__)


async def build(settings: TrainerSettings) -> Service:
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    torch.use_deterministic_algorithms(settings.trainer_deterministic, warn_only=True)
    set_torch_lanes(settings.trainer_torch_lanes)
    token = settings.client_token()
    store = WeightStoreClient(
        settings.weight_store_addr, retry_s=settings.weight_store_retry_s, token=token
    )
    env = EnvClient(settings.env_gateway_addr, token=token)
    trajectories = runtime.progress.stage("trajectories")
    runs = Runs(
        runtime, settings, store, env, (trajectories, runtime.progress.stage("step", liveness=True))
    )
    trajectories.pending = lambda: runs.collecting
    runtime.set_info(lambda: {"runs": runs.states()}, TrainerInfo)
    runtime.app.state.runs = runs
    runtime.app.state.training_sessions = TrainingSessions(
        store,
        settings.state_dir,
        settings.path_roots(),
        max_sessions=settings.trainer_max_training_sessions,
        redis=runtime.redis,
    )
    rollout_url = settings.trainer_rollout_url
    runtime.app.state.tinker = TinkerState(
        {name: str(path) for name, path in settings.trainer_tinker_models.items()},
        settings.state_dir / "tinker",
        store,
        settings.trainer_tinker_max_clients,
        RolloutSampler(rollout_url, token) if rollout_url else None,
        session_ttl_s=settings.trainer_tinker_session_ttl_s,
    )
    runtime.app.include_router(http.router)
    runtime.on_drain(runs.drain)
    loops: list[Callable[[], Awaitable[None]]] = [runs.resume_orphans]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # rank 0 of a torchrun job
        loops.append(lambda: keep_followers(runtime, settings))
    return Service(runtime, loops=loops)


async def keep_followers(runtime: ServiceRuntime, settings: TrainerSettings) -> None:
    """Join the process group at once (the followers wait for it) and ping them every quarter
    of the collective timeout, between commands (the torch thread runs one at a time), so a
    trainer with no run does not time out its followers, and a dead rank fails in minutes."""
    from treadle_trainer.backends import on_torch_thread
    from treadle_trainer.backends.group import init_distributed
    from treadle_trainer.backends.ranks import ping

    await on_torch_thread(init_distributed)
    while not runtime.stop_event.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runtime.stop_event.wait(), settings.trainer_dist_timeout_s / 4)
        if not runtime.stop_event.is_set():
            await on_torch_thread(ping)
