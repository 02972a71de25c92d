"""`vf1-tiny-guess`: a multi-turn game as a verifiers 0.4 taskset. The model finds a secret
number between 1 and `high` by calling `guess(number)`, which answers higher, lower or
correct, turn after turn (up to `max_turns` model turns). The secret is the task's data; the
task's `setup` puts it into the rollout's state, where the game's toolset (`tools.py`, its own
server) reads it and counts the guesses. Rewards: 1 for finding it, plus up to 0.5 the fewer
guesses it took; a metric reports the guesses.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from verifiers.v1.harnesses.null.harness import NullHarness

from vf1_tiny_guess.tools import GuessState, GuessToolset


class GuessData(vf.TaskData):
    secret: int
    high: int


class GuessTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class GuessTask(vf.Task[GuessData, GuessState, GuessTaskConfig]):
    @classmethod
    def toolsets(cls, config: GuessTaskConfig) -> list[vf.Toolset]:
        return [GuessToolset(config.tools)]

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        trace.state.secret = self.data.secret

    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        return 1.0 if trace.state.solved else 0.0

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        if not trace.state.solved:
            return 0.0
        return 1.0 / trace.state.guesses

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.state.guesses)


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    seed: int = 0
    high: int = 8
    task: GuessTaskConfig = GuessTaskConfig()


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        c = self.config
        rng = random.Random(c.seed)
        prompt = "Find my secret number from 1 to {high}: call guess(number) until it is correct."
        return [
            GuessTask(
                GuessData(
                    prompt=prompt.format(high=c.high), secret=rng.randint(1, c.high), high=c.high
                ),
                c.task,
            )
            for _ in range(c.num_tasks)
        ]


class GuessHarness(NullHarness):
    """The plain chat loop (it offers the game's tool), as this taskset's default."""


__all__ = ["GuessTaskset", "GuessHarness"]
