"""Rollout service: the policy engine, episodes, live weight swaps, the OpenAI-compatible API.

Redis tasks --TaskWorker--> EpisodeRunner --generate--> Engine (hf | vllm)
                                 |--create/step (gRPC)--> env-gateway
                                 |--score (NATS req/reply)--> reward
                                 '--trajectory--> Redis trajectories
NATS treadle.weights.{model} --WeightSync--fetch delta (gRPC)--> weight-store --> Engine swap
NATS treadle.weights.{model}.{run} --RunPolicies--> a LoRA run's adapter, beside the others
gRPC Generation.Generate / HTTP /v1/info, /v1/swaps, OpenAI /v1/chat/completions, ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from treadle_common.api.rollout import RolloutInfo
from treadle_common.proto.treadle.v1 import generation_pb2_grpc
from treadle_common.runtime.service import Service, ServiceRuntime
from treadle_rollout import errors, http
from treadle_rollout.engines.process import ProcessEngine
from treadle_rollout.grpc import POLICY, GenerationServicer
from treadle_rollout.replica import Rollout, build_engine
from treadle_rollout.settings import RolloutSettings
from treadle_rollout.worker import SERVICE


async def build(settings: RolloutSettings) -> Service:
    if settings.rollout_model is None:
        raise SystemExit("rollout needs TREADLE_ROLLOUT_MODEL (an HF model directory)")
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    model_dir = Path(settings.rollout_model)
    engine = await build_engine(settings, model_dir, settings.rollout_model_name or model_dir.name)
    rollout = Rollout(settings, runtime, engine)
    runtime.progress.add(rollout.sync.stage)
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, rollout.gate), runtime.make_grpc_server(POLICY)
    )
    runtime.add_check("env-gateway", rollout.env_check)
    runtime.add_check("weight-store", rollout.weights_check)
    runtime.set_info(lambda: http.info(rollout), RolloutInfo)
    runtime.app.state.rollout, runtime.app.state.frontend = rollout, rollout.frontend
    errors.install(runtime.app)
    runtime.app.include_router(http.router)
    loops: list[Callable[[], Awaitable[None]]] = [rollout.work, rollout.weights]
    if isinstance(engine, ProcessEngine):
        loops.append(engine.watch)  # the engine process dying stops the service
    return Service(runtime, loops=loops, on_close=[engine.close])
