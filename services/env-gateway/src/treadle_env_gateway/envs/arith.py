"""`arith`: single-turn arithmetic. The policy reads `a op b` and answers with the result."""

from __future__ import annotations

import random
from typing import Any

from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, register

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@register("arith")
class Arith(Env):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"arith-{split}-{seed}")
        max_operand = int(options.get("max_operand", 9))
        ops = list(options.get("ops", ["+"]))
        tasks = []
        for _ in range(num_tasks):
            a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
            tasks.append({"a": a, "b": b, "op": op, "answer": str(OPS[op](a, b))})
        return tasks

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        try:
            a, b, op = int(task["a"]), int(task["b"]), str(task["op"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"arith task needs integer 'a', 'b' and an 'op': {exc}") from exc
        if op not in OPS:
            raise EnvError(f"arith op {op!r} is not one of {sorted(OPS)}")
        self.task = task
        return [Message("user", f"{a}{op}{b}=")]

    async def step(self, action: Action) -> StepResult:
        answer = action.text.strip()
        return StepResult(
            observation=[], done=True, info={"answer": answer, "target": self.task.get("answer")}
        )
