"""`code_tests`: run the answer's code against the task's tests in the env-gateway sandbox
(env `python_tests` over gRPC; the reward service never executes code itself).

Task fields: `tests` (Python asserts), optionally `prompt`. A sandbox failure (not the code's
fault) is an error status; a timeout, memory exhaustion or crash of the code scores 0 with
the classification in the breakdown.
"""

from __future__ import annotations

import json

from treadle_common.clients.env import EnvClient
from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer
from treadle_reward.settings import RewardSettings


@register("code_tests")
class CodeTests(Scorer):
    def __init__(self, env_gateway_addr: str):
        self.address = env_gateway_addr
        self._client: EnvClient | None = None

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> CodeTests:
        return cls(settings.env_gateway_addr)

    async def score(self, request: ScoreInput) -> Score:
        if not isinstance(request.task.get("tests"), str):
            raise ValueError("code_tests needs the task's 'tests' (Python asserts)")
        if self._client is None:
            self._client = EnvClient(self.address)
        task = {"prompt": request.task.get("prompt", ""), "tests": request.task["tests"]}
        session = await self._client.create("python_tests", task, options=request.options)
        try:
            step = await self._client.step(session.session_id, request.answer)
        finally:
            await self._client.close_session(session.session_id)
        if step.status != "ok":
            raise RuntimeError(f"env-gateway {step.status}: {step.error}")
        sandbox = json.loads(step.info_json).get("sandbox", "")
        return Score(
            reward=step.reward, breakdown={"code_tests": step.reward, f"sandbox_{sandbox}": 1.0}
        )
