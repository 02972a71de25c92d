"""`env_reward`: the reward the environment itself gave the episode (`info.reward`), with its
breakdown (`info.breakdown`), e.g. a `verifiers` rubric's score computed in the env-gateway.
An episode whose env gave no reward is an error, never a 0."""

from __future__ import annotations

import math

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer


@register("env_reward")
class EnvReward(Scorer):
    deterministic = True

    async def score(self, request: ScoreInput) -> Score:
        reward = request.info.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"the env gave no numeric reward (info.reward = {reward!r})")
        if not math.isfinite(reward):
            raise ValueError(f"the env's reward is not finite: {reward!r}")
        breakdown = request.info.get("breakdown") or {}
        if not isinstance(breakdown, dict):
            raise ValueError("info.breakdown must be an object of numbers")
        return Score(
            reward=float(reward),
            breakdown={
                str(k): float(v)
                for k, v in breakdown.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            },
        )
