"""One rollout replica's parts and their loops (`Rollout`), and its engine (`build_engine`);
`app.py` wires them to the service runtime and its edges."""

from __future__ import annotations

from pathlib import Path

from treadle_common.auth import policy as auth
from treadle_common.clients.env import EnvClient
from treadle_common.clients.reward import RewardClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.fleet import scheduling
from treadle_common.fleet.quotas import TenantQuotas
from treadle_common.runtime.service import ServiceRuntime
from treadle_rollout import chat, openai_api, usage
from treadle_rollout.engines import prestart
from treadle_rollout.engines.base import Engine
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.engines.process import ProcessEngine
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.gate import RequestGate
from treadle_rollout.played import PlayedEpisodes
from treadle_rollout.policies import RunPolicies
from treadle_rollout.quota_gate import QuotaGate
from treadle_rollout.settings import RolloutSettings
from treadle_rollout.weight_sync import WeightSync
from treadle_rollout.worker import TaskWorker


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
            max_lora_rank=settings.rollout_vllm_max_lora_rank,
            max_loras=settings.rollout_vllm_max_loras,
            adapter_dir=settings.state_dir / "vllm-adapters",
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
    options = {
        "swap_policy": settings.rollout_swap_policy,
        "max_batch": settings.rollout_max_batch,
        "max_context": settings.rollout_max_context,
        "prefix_cache_mb": settings.rollout_prefix_cache_mb,
        "logit_noise": settings.rollout_fault_logit_noise,
    }
    if not settings.rollout_engine_process:
        cpus = prestart.options_for(settings)["cpus"]
        return HFEngine(model_dir, model_name, **options, cpus=cpus)  # type: ignore[arg-type]
    # the same options as `__main__`'s prestart: it then takes the process started there
    process = ProcessEngine(model_dir, model_name, prestart.options_for(settings))
    await process.start()
    return process


class Rollout:
    """The rollout service's parts: the engine, its weight sync, the OpenAI front end, and
    the task worker once NATS is connected (it needs the reward client)."""

    def __init__(self, settings: RolloutSettings, runtime: ServiceRuntime, engine: Engine):
        assert settings.rollout_model is not None
        self.settings, self.runtime, self.engine = settings, runtime, engine
        self.model_dir = Path(settings.rollout_model)
        self.model_name = settings.rollout_model_name or self.model_dir.name
        token = settings.client_token()
        self.store = WeightStoreClient(
            settings.weight_store_addr, retry_s=settings.weight_store_retry_s, token=token
        )
        # a group's hops together
        self.env = EnvClient(settings.env_gateway_addr, batch=True, token=token)
        self.sync = WeightSync(engine, self.store)
        self.policies = RunPolicies(engine, self.store)  # LoRA runs' adapters on this base
        self.gate = RequestGate(settings.rollout_max_queued)
        self.frontend = openai_api.OpenAIFrontend(
            engine,
            chat.SessionRecorder(engine.tokenizer, ttl_s=settings.rollout_session_ttl_s),
            gate=self.gate,
            tool_parser=settings.rollout_tool_parser,
            stream_interval_ms=settings.rollout_stream_interval_ms,
            stream_events_per_s=settings.rollout_stream_events_per_s,
        )
        self.worker: TaskWorker | None = None

    async def env_check(self) -> None:
        await self.env.list_envs()

    async def weights_check(self) -> None:
        """Unreachable weight-store: the old version keeps serving, readiness says so."""
        await self.store.list_versions(self.model_name)

    async def work(self) -> None:
        """Play the tasks of every active run (once NATS answers: rewards go over it)."""
        runtime, settings = self.runtime, self.settings
        nc = await runtime.wait_nats()
        reward = RewardClient(nc, settings.reward_timeout_s, batch=True)
        if self.engine.name != "openai":  # adapter policies follow their announcements
            self.policies.js = nc.jetstream()
        redis = runtime.redis

        async def fetched(policy: str, size: int) -> None:  # a LoRA run's policy's bytes
            run = policy.removeprefix(self.engine.model_name + ".")
            tenant = self.worker.share.tenant_of(run) if self.worker else auth.DEFAULT_TENANT
            await usage.record(redis, run, tenant, {"weight_bytes_fetched": size})

        self.policies.on_fetched = fetched
        self.frontend.sessions.redis, self.frontend.sessions.reward = runtime.redis, reward
        quotas = None
        if settings.tenant_max_episodes or settings.tenant_max_tokens_per_minute:
            quotas = TenantQuotas(
                redis, settings.tenant_max_episodes, settings.tenant_max_tokens_per_minute
            )
            self.frontend.generator.quota = QuotaGate(quotas)
        runner = EpisodeRunner(
            self.engine,
            self.engine.tokenizer,
            self.env,
            reward,
            settings.instance,
            generate_stage=runtime.progress.stage("generate", liveness=True),
            played=PlayedEpisodes(self.frontend),
            policies=self.policies,
        )
        worker = TaskWorker(
            runtime.redis,
            runner,
            self.sync,
            consumer=settings.instance,
            max_concurrent_tasks=settings.rollout_max_concurrent_tasks,
            reclaim_idle_ms=settings.rollout_reclaim_idle_ms,
            max_deliveries=settings.rollout_max_deliveries,
            policies=self.policies,
            policy=scheduling.make(settings.scheduling_policy),
            model=self.engine.model_name,
            quotas=quotas,
        )
        self.worker = worker
        tasks = runtime.progress.stage("tasks", lambda: len(worker.in_flight))
        worker.on_task_done = tasks.tick
        runtime.on_drain(worker.drain)
        await worker.run()

    async def weights(self) -> None:
        """Swap in every announced version (an openai engine is a fixed policy)."""
        if self.engine.name != "openai":
            await self.sync.run(await self.runtime.wait_nats())
