"""`arith_agent`: an agent written against the plain OpenAI client, trained by Treadle.

It asks the model `a+b=`; when the reply is not a number it says so and asks once more (a
second, recorded turn of the same conversation). The task set is the `arith` env's, so held-
out problems stay held out. Installed, it registers as env `arith_agent` (entry point
`treadle.envs`); `recipes/openai_agent.yaml` trains it.
"""

from __future__ import annotations

from typing import Any

from treadle_env_gateway.envs.agent import OpenAIAgentEnv
from treadle_env_gateway.envs.arith import Arith

RETRY = "Answer with the number only."


class ArithAgent(OpenAIAgentEnv):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        return Arith.sample_tasks(num_tasks, seed, split, options)

    async def reset(self, task: dict[str, Any], seed: int):
        await super().reset(task, seed)
        return await Arith(self.options).reset(task, seed)  # the question, as arith asks it

    async def run(self, client: Any, model: str, sampling: dict[str, Any]) -> dict[str, Any]:
        task = self.task
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"{task['a']}{task['op']}{task['b']}="}
        ]
        answer, turns = "", 0
        for _ in range(2):
            reply = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=sampling.get("max_tokens", 8)
            )
            turns += 1
            answer = (reply.choices[0].message.content or "").strip()
            if answer.lstrip("-").isdigit():
                break
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": RETRY},
            ]
        return {"answer": answer, "target": task["answer"], "agent_turns": turns}
