"""`vf1-tiny-arith`: two-digit addition as a verifiers 0.4 taskset, written the way v1
environment packages are (`vf-init`'s layout): typed `TaskData`, a `Task` whose `@reward`s
score the trace, a `Taskset` whose `load()` builds the tasks.

The prompt is `a+b=` as the user message (what Treadle's tiny test models read); the rewards
give 0.5 for the exact sum and 0.5 times the share of its digits in their places. The
package also exports a harness: verifiers' plain chat loop (its `null` harness), so that the
taskset plays as a chat by default rather than with the coding agent (`bash`).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from verifiers.v1.harnesses.null.harness import NullHarness


class ArithData(vf.TaskData):
    answer: str


def exact(reply: str, answer: str) -> float:
    return 1.0 if reply.strip() == answer else 0.0


def digits(reply: str, answer: str) -> float:
    text = reply.strip()
    hits = sum(1 for i, ch in enumerate(answer) if i < len(text) and text[i] == ch)
    return hits / max(len(answer), len(text), 1)


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=0.5)
    async def exact(self, trace: vf.Trace) -> float:
        return exact(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return digits(trace.last_reply, self.data.answer)


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    seed: int = 0
    """Different seeds, different problems (a held-out set is another seed)."""
    low: int = 10
    high: int = 99


def problems(num_tasks: int, seed: int, low: int, high: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num_tasks)]


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        c = self.config
        return [
            ArithTask(ArithData(prompt=f"{a}+{b}=", answer=str(a + b)), c.task)
            for a, b in problems(c.num_tasks, c.seed, c.low, c.high)
        ]


class ArithHarness(NullHarness):
    """The plain chat loop, as this taskset's default harness."""


__all__ = ["ArithTaskset", "ArithHarness"]
