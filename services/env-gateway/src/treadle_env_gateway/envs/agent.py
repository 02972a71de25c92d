"""`OpenAIAgentEnv`: an agent written against the OpenAI client, trained as an environment.

Subclass it, give it a dataset (`sample_tasks`) and an agent loop (`run`), register it like
any env (`@register`, the `treadle.envs` entry point group or `TREADLE_ENV_MODULES`):

    @register("arith_agent")
    class ArithAgent(OpenAIAgentEnv):
        @classmethod
        def sample_tasks(cls, num_tasks, seed, split, options): ...

        async def run(self, client, model, sampling):
            reply = await client.chat.completions.create(model=model, messages=[...])
            return {"answer": reply.choices[0].message.content}

`client` is an `openai.AsyncOpenAI` whose calls rollout answers over `Play` (every chat
completion recorded token-exact into the episode's trajectory; tool turns and the agent's own
messages are context, not trained on); `self.task` is the episode's task. What `run` returns
is the episode's `info`; the recipe's scorer scores the final assistant message (and may read
`info`), or the agent gives `info["reward"]` itself for `scorer: env_reward`.
"""

from __future__ import annotations

import abc
from typing import Any

from treadle_env_gateway.envs.base import Model, PlayedEnv, StepResult
from treadle_env_gateway.envs.relay import openai_client


class OpenAIAgentEnv(PlayedEnv):
    @abc.abstractmethod
    async def run(self, client: Any, model: str, sampling: dict[str, Any]) -> dict[str, Any]:
        """The agent's loop on `self.task`; returns the episode's info."""

    async def play(self, model: Model, model_name: str, sampling: dict[str, Any]) -> StepResult:
        client = openai_client(model)
        try:
            info = await self.run(client, model_name, sampling)
        finally:
            await client.close()
        reward = info.get("reward") if isinstance(info, dict) else None
        return StepResult(
            [],
            done=True,
            reward=float(reward) if isinstance(reward, (int, float)) else None,
            info=info if isinstance(info, dict) else {},
        )
