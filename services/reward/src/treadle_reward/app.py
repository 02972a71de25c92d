"""Reward service: scorers behind NATS request-reply (queue group) and HTTP.

rollout --NATS request treadle.reward.{scorer}--> ScoringService.handle --> Scorer.score
people  --POST /v1/score--------------------------> ScoringService.score
"""

from __future__ import annotations

from treadle_common.service import Service, ServiceRuntime
from treadle_reward import http
from treadle_reward.scorers import registry
from treadle_reward.settings import RewardSettings
from treadle_reward.worker import SERVICE, ScoringService


async def build(settings: RewardSettings) -> Service:
    runtime = ServiceRuntime(SERVICE, settings)
    modules = tuple(m.strip() for m in settings.scorer_modules.split(",") if m.strip())
    scoring = ScoringService(
        registry(settings, modules),
        timeout_s=settings.reward_timeout_s,
        max_concurrency=settings.reward_max_concurrency,
        cache_size=settings.reward_cache_size,
        stage=runtime.progress.stage("score", liveness=True),
    )
    runtime.set_info(lambda: {"scorers": sorted(scoring.scorers)})

    http.mount(runtime.app, scoring)

    async def subscribe() -> None:
        await scoring.subscribe(await runtime.wait_nats())

    return Service(runtime, loops=[subscribe])
