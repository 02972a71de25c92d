"""A run's experiment trackers (`logging.trackers`: W&B, MLflow, TensorBoard), fed by the
trainer, so a run started by any client is tracked.

    RunOwner._prepare  --> start(resumed)       config, once restored from a checkpoint or not
    RunStepper._account --> step(record)        the step's scalars (consistency metrics too)
    POST /v1/runs/{id}/evaluations --> evaluation(step, mean_reward)   as `eval/mean_reward`
    RunOwner._end      --> finish(status)       the final summary; the tracker run ends

Tracker libraries block (files, HTTP), so every call runs on the run's own worker thread, in
order, off the event loop and off the torch thread; `drain` waits for what is queued. A
tracker that fails is logged and counted (`treadle_trainer_tracker_errors_total`) and never
stops the run; one that fails to start is left out for the rest of the run.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from treadle_common.api.runs import FINAL_STATES, RunState, RunStatus, StepRecord
from treadle_common.config.recipe import RunConfig
from treadle_common.runtime.logs import get_logger
from treadle_trainer.metrics import TRACKER_ERRORS
from treadle_trainer.tracking.sinks import Sink, build_sink

log = get_logger(__name__)
SUMMARY_FIELDS = (
    "step",
    "trajectories_produced",
    "trajectories_consumed",
    "trajectories_trained",
    "trajectories_acked",
    "duplicates",
    "rejected",
    "tasks_fed",
    "resumed",
)
"""The run's counts in the final summary (with `exactly_once` and its usage)."""


def step_scalars(record: StepRecord) -> dict[str, float]:
    """A step record's numbers (histograms, strings and unset fields left out)."""
    return {
        name: float(value)
        for name, value in record.model_dump().items()
        if isinstance(value, int | float) and not isinstance(value, bool) and name != "step"
    }


def summary_of(status: RunStatus) -> dict[str, float]:
    summary = {name: float(getattr(status, name)) for name in SUMMARY_FIELDS}
    summary["exactly_once"] = float(status.exactly_once)
    usage = status.usage.model_dump()
    summary.update({f"usage.{k}": float(v) for k, v in usage.items()})
    return summary


class RunTracking:
    def __init__(self, config: RunConfig):
        run_dir = Path(config.output_dir) / config.run_id
        self.run_id = config.run_id
        self.config = config.model_dump(mode="json")
        self.sinks: list[Sink] = [
            build_sink(spec, config.run_id, run_dir) for spec in config.logging.trackers
        ]
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"trackers-{config.run_id}")
        self._last: Future | None = None

    def start(self, resumed: bool) -> None:
        self._submit("open", self.config, resumed)

    def step(self, record: StepRecord) -> None:
        self._submit("metrics", record.step, step_scalars(record))

    def evaluation(self, step: int, mean_reward: float, num_tasks: int) -> None:
        values = {"eval/mean_reward": mean_reward, "eval/num_tasks": float(num_tasks)}
        self._submit("metrics", step, values)

    async def finish(self, status: RunStatus, outcome: RunState) -> None:
        """The final summary to every tracker (a run that ended), or only what is pending (a
        run another trainer resumes: its tracker runs go on there); then wait until all is
        written."""
        if outcome in FINAL_STATES:
            self._submit("close", summary_of(status), outcome)
        else:
            self._submit("suspend")
        await self.drain()
        self._thread.shutdown(wait=False)

    async def drain(self) -> None:
        if self._last is not None:
            await asyncio.wrap_future(self._last)

    def _submit(self, call: str, *args: Any) -> None:
        if self.sinks:
            self._last = self._thread.submit(self._each, call, args)

    def _each(self, call: str, args: tuple) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, call)(*args)
            except Exception as exc:  # a tracker never stops the run
                TRACKER_ERRORS.labels(self.run_id, sink.name, call).inc()
                log.warning(
                    "tracker failed", run=self.run_id, tracker=sink.name, call=call, error=repr(exc)
                )
                if call == "open":
                    self.sinks.remove(sink)
