"""`calculator`: multi-turn tool use. The policy may call the `calculator` tool, reads the
result, then answers. A malformed call is answered with a tool message that says what was
wrong, and the episode goes on."""

from __future__ import annotations

import random
from typing import Any

from treadle_common.tasks.safe_math import ExpressionError, evaluate, format_number
from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+7)*3"}},
            "required": ["expression"],
        },
    },
}


@register("calculator")
class Calculator(Env):
    tools = [CALCULATOR]

    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"calculator-{split}-{seed}")
        top = option(options, "max_number", 99, 2, 10**6)
        tasks = []
        for _ in range(num_tasks):
            a, b, c = (rng.randint(2, top) for _ in range(3))
            expression = f"({a}+{b})*{c}"
            tasks.append(
                {"expression": expression, "answer": format_number(evaluate(expression)[0])}
            )
        return tasks

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        if not isinstance(task.get("expression"), str) or "answer" not in task:
            raise EnvError("calculator task needs an 'expression' string and an 'answer'")
        self.task = task
        self.max_turns = option(self.options, "max_turns", 4, 1, 64)
        self.turns = 0
        return [
            Message(
                "user",
                f"What is {task['expression']}? "
                "Use the calculator tool, then answer with the number.",
            )
        ]

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        if action.tool_calls:
            replies = [
                Message("tool", self._call(c.name, c.arguments), tool_call_id=c.id)
                for c in action.tool_calls
            ]
            if self.turns < self.max_turns:
                return StepResult(replies, done=False)
            return StepResult(
                replies, done=True, reward=0.0, info={"answer": "", "target": self.task["answer"]}
            )
        answer = action.text.strip().split()[-1].rstrip(".") if action.text.strip() else ""
        solved = answer == str(self.task["answer"])
        return StepResult(
            [],
            done=True,
            reward=float(solved),
            info={"answer": answer, "target": self.task["answer"]},
        )

    @staticmethod
    def _call(name: str, arguments: dict[str, Any]) -> str:
        if name != "calculator":
            return f"error: unknown tool {name!r}; the only tool is 'calculator'"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return 'error: \'expression\' must be a string, e.g. {"expression": "(2+3)*4"}'
        try:
            return format_number(evaluate(expression)[0])
        except ExpressionError as exc:
            return f"error: {exc}"
