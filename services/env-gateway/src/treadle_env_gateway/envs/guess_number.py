"""`guess_number`: multi-turn; the policy guesses, the env answers higher / lower / correct."""

from __future__ import annotations

import random
import re
from typing import Any

from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option

_INT = re.compile(r"-?\d+")


@register("guess_number")
class GuessNumber(Env):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"guess-{split}-{seed}")
        low = option(options, "low", 1, -(10**9), 10**9)
        high = option(options, "high", 100, low, 10**9)
        targets = [rng.randint(low, high) for _ in range(num_tasks)]
        # `answer` lets `exact_match` score the final guess
        return [{"low": low, "high": high, "target": t, "answer": str(t)} for t in targets]

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        try:
            self.low, self.high, self.target = (
                int(task["low"]),
                int(task["high"]),
                int(task["target"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(
                f"guess_number task needs integer 'low', 'high', 'target': {exc}"
            ) from exc
        self.max_guesses = option(self.options, "max_guesses", 8, 1, 64)
        self.guesses: list[int] = []
        return [
            Message(
                "user",
                f"I am thinking of a number from {self.low} to {self.high}. "
                f"Guess it; answer with one number.",
            )
        ]

    async def step(self, action: Action) -> StepResult:
        found = _INT.findall(action.text)
        if not found:
            reply = "That is not a number. Answer with one number."
        else:
            guess = int(found[-1])
            self.guesses.append(guess)
            if guess == self.target:
                return StepResult(
                    [], done=True, reward=1.0, info={"guesses": self.guesses, "target": self.target}
                )
            reply = "Higher." if guess < self.target else "Lower."
        if len(self.guesses) >= self.max_guesses:
            return StepResult(
                [Message("user", reply)],
                done=True,
                reward=0.0,
                info={"guesses": self.guesses, "target": self.target},
            )
        return StepResult([Message("user", reply)], done=False)
