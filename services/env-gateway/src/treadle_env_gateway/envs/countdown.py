"""`countdown`: reach the target with the given numbers (each at most once) and + - * /."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from treadle_common.tasks.safe_math import ExpressionError, evaluate
from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option


def _answer_expression(text: str) -> str:
    """The expression in the last non-empty line, without a trailing `= target`."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].split("=")[0] if lines else ""


@register("countdown")
class Countdown(Env):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"countdown-{split}-{seed}")
        count = option(options, "num_numbers", 3, 2, 6)
        top = option(options, "max_number", 10, 1, 1000)
        tasks: list[dict] = []
        while len(tasks) < num_tasks:
            numbers = [rng.randint(1, top) for _ in range(count)]
            value = numbers[0]
            for n in numbers[1:]:  # a target reachable by construction
                value = rng.choice([value + n, value * n, value - n])
            if value > 0:
                tasks.append({"numbers": numbers, "target": value})
        return tasks

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        try:
            self.numbers, self.target = [int(n) for n in task["numbers"]], int(task["target"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"countdown task needs integer 'numbers' and 'target': {exc}") from exc
        listed = ", ".join(map(str, self.numbers))
        return [
            Message(
                "user",
                f"Using the numbers {listed} (each at most once) and + - * /, "
                f"write an expression equal to {self.target}.",
            )
        ]

    async def step(self, action: Action) -> StepResult:
        expression = _answer_expression(action.text)
        info: dict[str, Any] = {"expression": expression, "target": self.target}
        try:
            value, used = evaluate(expression)
        except ExpressionError as exc:
            return StepResult(
                [], done=True, reward=0.0, info={**info, "valid": False, "error": str(exc)}
            )
        if Counter(used) - Counter(self.numbers):
            return StepResult(
                [],
                done=True,
                reward=0.0,
                info={**info, "valid": False, "error": "uses numbers not given"},
            )
        solved = value == self.target
        return StepResult(
            [], done=True, reward=float(solved), info={**info, "valid": True, "value": str(value)}
        )
