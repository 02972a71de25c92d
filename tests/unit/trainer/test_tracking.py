"""`logging.trackers`: the recipe's section, what a step sends, and a tracker that fails."""

from __future__ import annotations

import asyncio

import pytest

from treadle_common.api.runs import RunStatus, StepRecord
from treadle_common.config.recipe import RunConfig
from treadle_trainer.tracking import RunTracking, step_scalars, summary_of
from treadle_trainer.tracking.sinks import Sink, flatten, missing_library


def config(**logging) -> RunConfig:
    return RunConfig.model_validate({"model": {"name": "m", "path": "/m"}, "logging": logging})


def test_the_section_takes_each_tracker_once():
    cfg = config(trackers=[{"type": "wandb", "mode": "offline"}, {"type": "tensorboard"}])
    assert [t.type for t in cfg.logging.trackers] == ["wandb", "tensorboard"]
    with pytest.raises(ValueError, match="names a tracker twice"):
        config(trackers=[{"type": "mlflow"}, {"type": "mlflow", "experiment": "x"}])
    with pytest.raises(ValueError, match="tracking_uri"):  # endpoints are not a recipe's
        config(trackers=[{"type": "mlflow", "tracking_uri": "file:///etc"}])
    assert config().logging.trackers == []


def test_a_step_sends_its_numbers_only():
    record = StepRecord(
        step=3,
        version=4,
        mean_reward=0.5,
        num_trajectories=8,
        max_staleness=1,
        loss=0.1,
        grad_norm=2.0,
        duration_s=1.5,
        publish_s=0.2,
        ratio_histogram=[1, 2],
        off_policy="tis",
    )
    values = step_scalars(record)
    assert values["loss"] == 0.1 and values["mean_reward"] == 0.5 and values["version"] == 4.0
    assert "step" not in values and "ratio_histogram" not in values and "off_policy" not in values
    assert "publish_duration_s" not in values  # unset (None)
    status = RunStatus(run_id="r", step=3, trajectories_trained=24)
    summary = summary_of(status)
    assert summary["step"] == 3.0 and summary["trajectories_trained"] == 24.0
    assert "exactly_once" in summary and "usage.trainer_s" in summary


def test_flatten_names_nested_fields():
    assert flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [2], "e": {}}


class Recording(Sink):
    name = "recording"

    def __init__(self, fail_on: str = ""):
        self.calls: list[tuple] = []
        self.fail_on = fail_on

    def _call(self, *call) -> None:
        if call[0] == self.fail_on:
            raise RuntimeError(f"{self.fail_on} failed")
        self.calls.append(call)

    def open(self, config, resumed):
        self._call("open", resumed)

    def metrics(self, step, values):
        self._call("metrics", step, values)

    def close(self, summary, state):
        self._call("close", state)

    def suspend(self):
        self._call("suspend")


def tracking(*sinks: Sink) -> RunTracking:
    out = RunTracking(config())
    out.sinks = list(sinks)
    return out


def test_calls_reach_every_tracker_in_order_and_a_failure_stops_nothing():
    good, bad = Recording(), Recording(fail_on="metrics")
    t = tracking(bad, good)
    t.start(resumed=True)
    t.evaluation(2, 0.25, 8)
    asyncio.run(t.finish(RunStatus(run_id="r"), "succeeded"))
    assert good.calls == [
        ("open", True),
        ("metrics", 2, {"eval/mean_reward": 0.25, "eval/num_tasks": 8.0}),
        ("close", "succeeded"),
    ]
    assert bad.calls == [("open", True), ("close", "succeeded")]


def test_a_tracker_that_cannot_start_is_left_out_and_a_handed_off_run_is_suspended():
    good, bad = Recording(), Recording(fail_on="open")
    t = tracking(bad, good)
    t.start(resumed=False)
    t.evaluation(1, 0.5, 1)
    asyncio.run(t.finish(RunStatus(run_id="r"), "handed_off"))
    assert bad.calls == [] and t.sinks == [good]
    assert [c[0] for c in good.calls] == ["open", "metrics", "suspend"]


def test_a_missing_library_is_named():
    cfg = config(trackers=[{"type": "tensorboard"}])
    assert missing_library(cfg.logging.trackers[0]) is None  # installed in the dev venv
