"""`exact_match`: 1.0 when the normalized answer equals the task's reference answer."""

from __future__ import annotations

import re

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer, reference

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalize(text: str) -> str:
    return " ".join(text.strip().lower().rstrip(".").split())


@register("exact_match")
class ExactMatch(Scorer):
    """Options: `field` (task key of the reference, default `answer`),
    `extract: last_number` (compare only the last number in the answer)."""

    deterministic = True

    async def score(self, request: ScoreInput) -> Score:
        target = reference(request)
        answer = request.answer
        if request.options.get("extract") == "last_number":
            numbers = _NUMBER.findall(answer)
            answer = numbers[-1] if numbers else ""
        hit = normalize(answer) == normalize(target)
        return Score(reward=1.0 if hit else 0.0, breakdown={"exact_match": 1.0 if hit else 0.0})
