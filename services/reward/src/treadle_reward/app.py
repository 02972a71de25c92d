"""Reward service: scorers behind NATS request-reply (queue group) and HTTP.

rollout --NATS request treadle.reward.{scorer}--> ScoringService.handle --> Scorer.score
people  --POST /v1/score--------------------------> ScoringService.score
"""

from __future__ import annotations

import asyncio

from treadle_common import names
from treadle_common.runtime.service import Service, ServiceRuntime
from treadle_reward import http
from treadle_reward.pool import ScorerPool
from treadle_reward.scorers import registry
from treadle_reward.scorers.base import CpuScorer
from treadle_reward.settings import RewardSettings
from treadle_reward.worker import SERVICE, ScoringService


async def build(settings: RewardSettings) -> Service:
    runtime = ServiceRuntime(SERVICE, settings)
    modules = tuple(m.strip() for m in settings.scorer_modules.split(",") if m.strip())
    scorers = registry(settings, modules)
    pool = None
    if settings.reward_cpu_workers > 0:
        pool = ScorerPool(settings.reward_cpu_workers, settings.reward_timeout_s)
        for scorer in scorers.values():
            if isinstance(scorer, CpuScorer):
                scorer.pool = pool
    scoring = ScoringService(
        scorers,
        timeout_s=settings.reward_timeout_s,
        max_concurrency=settings.reward_max_concurrency,
        cache_size=settings.reward_cache_size,
        stage=runtime.progress.stage("score", liveness=True),
        max_in_flight=settings.reward_max_in_flight,
    )
    runtime.set_info(lambda: {"scorers": sorted(scoring.scorers)})

    runtime.app.state.scoring = scoring
    runtime.app.include_router(http.router)

    ping = "treadle.reward._ping." + settings.instance.replace(".", "_").replace(" ", "_")

    async def subscribe() -> None:
        await scoring.subscribe(await runtime.wait_nats(), ping)

    async def serving() -> None:
        """Ready means able to serve: subscribed, and NATS routes a request to this replica
        (after a NATS restart, once the client has resubscribed)."""
        if not scoring.subscribed or runtime.nats is None:
            raise RuntimeError(f"not subscribed to {names.REWARD_WILDCARD} yet")
        await runtime.nats.request(ping, b"", timeout=1.0)

    runtime.add_check("subscription", serving)

    async def close_pool() -> None:
        if pool is not None:
            await asyncio.to_thread(pool.close)

    return Service(runtime, loops=[subscribe], on_close=[close_pool])
