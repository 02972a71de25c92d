"""`composite`: a weighted sum of other scorers, each with its own options.

    options: {"scorers": [{"name": "math_verify", "weight": 0.9},
                          {"name": "format_regex", "weight": 0.1, "options": {"pattern": "boxed"}}]}
A failing component fails the whole score (reported, never silently 0).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer


@register("composite")
class Composite(Scorer):
    def __init__(self) -> None:
        self.registry: dict[str, Scorer] = {}

    async def score(self, request: ScoreInput) -> Score:
        parts = request.options.get("scorers")
        if not isinstance(parts, list) or not parts:
            raise ValueError("composite needs option 'scorers': a list of {name, weight, options}")
        for part in parts:
            if part.get("name") not in self.registry or part["name"] == "composite":
                raise ValueError(
                    f"composite: unknown scorer {part.get('name')!r}; "
                    f"known: {sorted(self.registry)}"
                )
        scores = await asyncio.gather(
            *(
                self.registry[p["name"]].score(replace(request, options=p.get("options", {})))
                for p in parts
            )
        )
        breakdown: dict[str, float] = {}
        total = 0.0
        for part, score in zip(parts, scores, strict=True):
            weight = float(part.get("weight", 1.0))
            total += weight * score.reward
            breakdown[part["name"]] = score.reward
        return Score(reward=total, breakdown=breakdown)
