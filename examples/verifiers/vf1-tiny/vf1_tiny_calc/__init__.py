"""`vf1-tiny-calc`: `vf1-tiny-arith`'s sums with a tool: the task serves an MCP toolset with
`add(a, b)` (a verifiers 0.4 `Toolset`, `tools.py`, which verifiers runs as a server of its
own: `python -m vf1_tiny_calc.tools`), which the
model may call before it answers; the rewards are the arithmetic's, a metric counts the tool
calls. Plays with the plain chat loop (this package's harness), which offers the toolset's
tools to the model and answers its calls.
"""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.harnesses.null.harness import NullHarness
from vf1_tiny_arith import ArithConfig, ArithData, digits, exact, problems

from vf1_tiny_calc.tools import CalcToolset


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[ArithData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=0.5)
    async def exact(self, trace: vf.Trace) -> float:
        return exact(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return digits(trace.last_reply, self.data.answer)

    @vf.metric
    async def model_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.calls))


class CalcConfig(ArithConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        c = self.config
        return [
            CalcTask(ArithData(prompt=f"{a}+{b}=", answer=str(a + b)), c.task)
            for a, b in problems(c.num_tasks, c.seed, c.low, c.high)
        ]


class CalcHarness(NullHarness):
    """The plain chat loop (it offers the toolset's tools), as this taskset's default."""


__all__ = ["CalcTaskset", "CalcHarness"]
