"""`llm_judge`: an LLM grades the answer against a rubric, through any OpenAI-compatible
`/v1/chat/completions` endpoint (vLLM, the rollout service, a hosted API).

The endpoint and model come from the service settings (`TREADLE_JUDGE_BASE_URL`,
`TREADLE_JUDGE_MODEL`, key from `TREADLE_JUDGE_API_KEY`), never from requests, so a request
cannot point the service at an arbitrary URL. Options: `rubric`, `scale` (the judge answers
0..scale, default 10). The score is parsed from "Score: N" (or the last number) and divided by
`scale`; an unparseable reply is an error, not a zero.
"""

from __future__ import annotations

import re

import httpx

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer
from treadle_reward.settings import RewardSettings

DEFAULT_RUBRIC = "Judge whether the answer correctly and completely solves the task."
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(text: str, scale: float) -> float:
    found = _SCORE.findall(text) or _NUMBER.findall(text)
    if not found:
        raise ValueError(f"judge reply has no score: {text[:200]!r}")
    value = float(found[-1])
    if not 0 <= value <= scale:
        raise ValueError(f"judge score {value} is outside 0..{scale}")
    return value / scale


@register("llm_judge")
class LLMJudge(Scorer):
    def __init__(self, base_url: str = "", model: str = "", api_key: str = ""):
        self.base_url = (base_url or "").rstrip("/")
        self.model = model or ""
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> LLMJudge:
        return cls(settings.judge_base_url, settings.judge_model, settings.judge_api_key)

    async def score(self, request: ScoreInput) -> Score:
        if not self.base_url:
            raise ValueError(
                "llm_judge needs TREADLE_JUDGE_BASE_URL (an OpenAI-compatible endpoint)"
            )
        scale = float(request.options.get("scale", 10))
        rubric = request.options.get("rubric", DEFAULT_RUBRIC)
        messages = [
            {
                "role": "system",
                "content": f"{rubric}\nReply with 'Score: N' where N is from 0 to {scale:g}.",
            },
            {"role": "user", "content": f"Task:\n{request.task}\n\nAnswer:\n{request.answer}"},
        ]
        async with httpx.AsyncClient(timeout=60, headers=self.headers) as client:
            response = await client.post(
                f"{self.base_url}/chat/completions",
                json={"model": self.model, "messages": messages, "temperature": 0},
            )
            response.raise_for_status()
        reply = response.json()["choices"][0]["message"]["content"]
        value = parse_score(reply, scale)
        return Score(reward=value, breakdown={"llm_judge": value})
