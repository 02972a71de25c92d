"""`format_regex`: 1.0 when the answer matches a pattern (the format of a good answer)."""

from __future__ import annotations

import regex

from treadle_reward.scorers import register
from treadle_reward.scorers.base import CpuScorer, Score, ScoreInput

TIMEOUT_S = 1.0  # patterns come from requests: a catastrophic one must not stall the replica


@register("format_regex")
class FormatRegex(CpuScorer):
    """Options: `pattern` (required), `full_match` (default false: search anywhere)."""

    @classmethod
    def compute(cls, request: ScoreInput) -> Score:
        pattern = request.options.get("pattern")
        if not isinstance(pattern, str):
            raise ValueError("format_regex needs option 'pattern' (a regular expression)")
        try:
            compiled = regex.compile(pattern, regex.DOTALL)
        except regex.error as exc:
            raise ValueError(f"invalid pattern: {exc}") from exc
        match = compiled.fullmatch if request.options.get("full_match") else compiled.search
        hit = match(request.answer, timeout=TIMEOUT_S) is not None
        return Score(reward=float(hit), breakdown={"format_regex": float(hit)})
