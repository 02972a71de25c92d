"""Rollout service: the policy engine, episodes, live weight swaps, the OpenAI-compatible API.

Redis tasks --TaskWorker--> EpisodeRunner --generate--> Engine (hf | vllm)
                                 |--create/step (gRPC)--> env-gateway
                                 |--score (NATS req/reply)--> reward
                                 '--trajectory--> Redis trajectories
NATS treadle.weights.{model} --WeightSync--fetch delta (gRPC)--> weight-store --> Engine swap
gRPC Generation.Generate / HTTP /v1/info, /v1/swaps, OpenAI /v1/chat/completions, ...
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import grpc
import torch

from treadle_common.api.rollout import RolloutInfo, Swap, Swaps
from treadle_common.clients.env import EnvClient
from treadle_common.clients.reward import RewardClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.proto.treadle.v1 import generation_pb2 as gpb
from treadle_common.proto.treadle.v1 import generation_pb2_grpc
from treadle_common.service import ServiceRuntime
from treadle_rollout import evaluate, metrics, openai_api
from treadle_rollout.engines.base import ContextOverflow, Engine, Sampling
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.settings import RolloutSettings
from treadle_rollout.weight_sync import WeightSync
from treadle_rollout.worker import SERVICE, TaskWorker


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Generate(self, request: gpb.GenerateRequest, context):
        s = request.sampling
        sampling = Sampling(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            max_new_tokens=s.max_new_tokens or 16,
            seed=s.seed or None,  # proto3: 0 = unseeded
        )
        try:
            gen = await self.engine.generate(list(request.prompt_tokens), sampling)
        except ContextOverflow as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return gpb.GenerateResult(
            request_id=request.request_id,
            tokens=gen.tokens,
            logprobs=gen.logprobs,
            token_versions=gen.versions,
            finish_reason=gen.finish_reason,
        )


async def build_engine(settings: RolloutSettings, model_dir: Path, model_name: str) -> Engine:
    if settings.rollout_engine == "vllm":
        from treadle_rollout.engines.vllm import VLLMEngine

        engine = VLLMEngine(
            model_dir,
            model_name,
            swap_policy=settings.rollout_swap_policy,
            max_context=settings.rollout_max_context or 2048,
            kv_cache_gb=settings.rollout_vllm_kv_cache_gb,
            dtype=settings.rollout_vllm_dtype,
        )
        await engine.start()
        return engine
    if settings.rollout_engine == "openai":
        from treadle_rollout.engines.openai import OpenAIEngine

        if not settings.rollout_openai_base_url:
            raise SystemExit("the openai engine needs TREADLE_ROLLOUT_OPENAI_BASE_URL")
        return OpenAIEngine(
            model_dir,
            model_name,
            base_url=settings.rollout_openai_base_url,
            served_model=settings.rollout_openai_model or None,
            api_key=settings.rollout_openai_api_key,
        )
    return HFEngine(
        model_dir,
        model_name,
        swap_policy=settings.rollout_swap_policy,
        max_batch=settings.rollout_max_batch,
        max_context=settings.rollout_max_context,
        prefix_cache_mb=settings.rollout_prefix_cache_mb,
    )


async def main(settings: RolloutSettings) -> None:
    if settings.rollout_model is None:
        raise SystemExit("rollout needs TREADLE_ROLLOUT_MODEL (an HF model directory)")
    model_dir = Path(settings.rollout_model)
    model_name = settings.rollout_model_name or model_dir.name
    runtime = ServiceRuntime(SERVICE, settings, uses_redis=True)
    if settings.torch_threads:  # before any torch work: every thread it starts follows
        torch.set_num_threads(settings.torch_threads)
    engine = await build_engine(settings, model_dir, model_name)
    store = WeightStoreClient(settings.weight_store_addr)
    env = EnvClient(settings.env_gateway_addr, batch=True)  # a group's hops travel together
    sync = WeightSync(engine, store)
    runtime.progress.add(sync.stage)
    server = runtime.make_grpc_server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    frontend = openai_api.OpenAIFrontend(
        engine,
        openai_api.SessionRecorder(engine.tokenizer, ttl_s=settings.rollout_session_ttl_s),
    )
    openai_api.mount(runtime.app, frontend)

    async def env_check() -> None:
        await env.list_envs()

    async def weights_check() -> None:
        """Unreachable weight-store: the old version keeps serving, readiness says so."""
        await store.list_versions(model_name)

    runtime.add_check("env-gateway", env_check)
    runtime.add_check("weight-store", weights_check)
    holder: dict[str, TaskWorker] = {}
    evaluate.mount(runtime.app, lambda: holder["worker"].runner if "worker" in holder else None)

    def info() -> dict:
        worker = holder.get("worker")
        metrics.ENGINE_RUNNING.set(engine.running)
        return {
            "model": model_name,
            "model_dir": str(model_dir.resolve()),
            "engine": engine.name,
            "swap_policy": settings.rollout_swap_policy,
            "policy_version": engine.version,
            "version_lag": sync.version_lag,
            "weight_sync_error": sync.last_error,
            "swaps": len(sync.swaps),
            "last_swap": asdict(sync.swaps[-1]) if sync.swaps else None,
            "engine_stats": engine.stats(),
            "engine_requests": engine.running,
            "engine_busy_fraction": round(engine.busy_fraction(), 4),
            "engine_busy_s": round(engine.busy_seconds(), 3),
            "tasks_done": worker.tasks_done if worker else 0,
            "tasks_invalid": worker.invalid_tasks if worker else 0,
            "tasks_cancelled": worker.cancelled_tasks if worker else 0,
            "admission_waits": worker.admission_waits if worker else 0,
            "trajectories_pushed": worker.trajectories_pushed if worker else 0,
            "recorded_sessions": len(frontend.recorder.sessions),
        }

    runtime.set_info(info, RolloutInfo)

    @runtime.app.get("/v1/swaps", tags=["weights"])
    async def swaps() -> Swaps:
        return Swaps(swaps=[Swap(**asdict(s)) for s in sync.swaps])

    async def work() -> None:
        nc = await runtime.wait_nats()
        reward = RewardClient(nc, settings.reward_timeout_s, batch=True)
        frontend.redis, frontend.reward = runtime.redis, reward
        runner = EpisodeRunner(
            engine,
            engine.tokenizer,
            env,
            reward,
            settings.instance,
            generate_stage=runtime.progress.stage("generate"),
        )
        worker = TaskWorker(
            runtime.redis,
            runner,
            sync,
            consumer=settings.instance,
            max_concurrent_tasks=settings.rollout_max_concurrent_tasks,
        )
        holder["worker"] = worker
        tasks = runtime.progress.stage("tasks", lambda: len(worker.in_flight))
        worker.on_task_done = tasks.tick
        runtime.on_drain(worker.drain)
        await worker.run()

    async def weights() -> None:
        if engine.name == "openai":
            return  # a fixed policy: nothing to swap
        await sync.run(await runtime.wait_nats())

    try:
        await runtime.serve(work(), weights())
    finally:
        await engine.close()
