"""`digit_match`: partial credit for a numeric answer, digit by digit from the right.

reward = (reference digits matched in place, aligned at the units digit) / max(len(reference),
len(answer)), so a right answer scores 1.0, a wrong length is penalized, and an answer that
gets the units right but misses a carry still earns something. Used with `exact_match` in a
`composite` it gives a tiny policy a gradient before it is ever fully right.
"""

from __future__ import annotations

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer, reference
from treadle_reward.scorers.exact_match import normalize


def digit_credit(answer: str, reference: str) -> float:
    if not answer or not reference:
        return float(answer == reference)
    matched = sum(a == r for a, r in zip(reversed(answer), reversed(reference), strict=False))
    return matched / max(len(answer), len(reference))


@register("digit_match")
class DigitMatch(Scorer):
    """Options: `field` (task key of the reference, default `answer`)."""

    deterministic = True

    async def score(self, request: ScoreInput) -> Score:
        credit = digit_credit(normalize(request.answer), normalize(reference(request)))
        return Score(reward=credit, breakdown={"digit_match": credit})
