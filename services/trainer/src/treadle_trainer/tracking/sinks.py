"""One experiment tracker each, through its own client library (imported only when a recipe
names it): W&B (`wandb`), MLflow (`MlflowClient`, no global active run, so several runs in
one trainer never mix) and TensorBoard (torch's `SummaryWriter`).

Every sink is called from one worker thread (`RunTracking`), in order:

    open(config, resumed) --> metrics(step, {name: value})* --> close(summary, state)
                                                              or suspend() (handed off)

A resumed run continues the tracker run it started: W&B by id (`resume="allow"`), MLflow by
the run's `treadle.run_id` tag, TensorBoard by appending to the run's own log directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from treadle_common.config.recipe import MlflowTracker, Tracker, WandbTracker

RUN_TAG = "treadle.run_id"
"""The MLflow tag that names the Treadle run (how a resumed run finds its MLflow run)."""
STEP_METRIC = "trainer/step"
"""W&B: the x-axis of every metric."""
MLFLOW_PARAM_CHARS = 6000
"""MLflow refuses longer parameter values."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class Sink(ABC):
    """A tracker as the trainer drives it (always from one thread, in order)."""

    name: str

    @abstractmethod
    def open(self, config: dict[str, Any], resumed: bool) -> None:
        """Start or continue the tracker run; record the run's resolved config."""

    @abstractmethod
    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Scalars at a trainer step."""

    @abstractmethod
    def close(self, summary: dict[str, Any], state: str) -> None:
        """The final summary; the tracker run ends (`state`: the run's final state)."""

    @abstractmethod
    def suspend(self) -> None:
        """Write out what is pending and let go: another trainer resumes the run."""


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, spec: WandbTracker, run_id: str, run_dir: Path):
        self.spec, self.run_id, self.run_dir = spec, run_id, run_dir
        self.run: Any = None

    def open(self, config: dict[str, Any], resumed: bool) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            mode=self.spec.mode,
            dir=str(self.run_dir),
            id=self.run_id,
            name=self.run_id,
            resume="allow",
            reinit="create_new",  # several runs in one trainer process, each its own
            config=config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        # every metric against the trainer's step, logged as a value: an evaluation of step
        # N may arrive after step N + 1 (async runs), which W&B's own `step` would drop
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, STEP_METRIC: step})

    def close(self, summary: dict[str, Any], state: str) -> None:
        self.run.summary.update({**summary, "state": state})
        self.run.finish(exit_code=0 if state == "succeeded" else 1)

    def suspend(self) -> None:
        self.run.finish(exit_code=0)


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, spec: MlflowTracker, run_id: str, run_dir: Path):
        self.spec, self.run_id = spec, run_id
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").as_uri()
        self.client: Any = None
        self.mlflow_run = ""

    def open(self, config: dict[str, Any], resumed: bool) -> None:
        if self.uri.startswith("file:"):  # MLflow 3 asks for this to use its file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=self.uri)
        experiment = client.get_experiment_by_name(self.spec.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.spec.experiment)
        )
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{self.run_id}'", max_results=1
        )
        if found:  # a resumed run: the same MLflow run, running again
            self.mlflow_run = found[0].info.run_id
            client.update_run(self.mlflow_run, status="RUNNING")
            return
        run = client.create_run(experiment_id, run_name=self.run_id, tags={RUN_TAG: self.run_id})
        self.mlflow_run = run.info.run_id
        params = [
            Param(key, json.dumps(value)[:MLFLOW_PARAM_CHARS])
            for key, value in flatten(config).items()
        ]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.mlflow_run, params=params[i : i + 100])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self.mlflow_run, metrics=batch)

    def close(self, summary: dict[str, Any], state: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        scalars = [Metric(f"final/{k}", float(v), now, 0) for k, v in summary.items()]
        self.client.log_batch(self.mlflow_run, metrics=scalars)
        self.client.set_tag(self.mlflow_run, "treadle.state", state)
        self.client.set_terminated(
            self.mlflow_run, "FINISHED" if state == "succeeded" else "FAILED"
        )

    def suspend(self) -> None:
        pass  # every call was written through; the run stays RUNNING for its next owner


class TensorboardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        self.log_dir = run_dir / "tensorboard"
        self.writer: Any = None

    def open(self, config: dict[str, Any], resumed: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir))  # a resumed run appends a new file
        if not resumed:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", 0)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, summary: dict[str, Any], state: str) -> None:
        last = int(summary.get("step", 0))
        for name, value in summary.items():
            self.writer.add_scalar(f"final/{name}", value, last)
        self.writer.add_text("summary", json.dumps({**summary, "state": state}), last)
        self.writer.close()

    def suspend(self) -> None:
        self.writer.close()


LIBRARIES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
"""The module each tracker kind imports (`treadle-trainer[trackers]` installs them)."""


def missing_library(spec: Tracker) -> str | None:
    """The library `spec`'s tracker needs, if it is not installed."""
    module = LIBRARIES[spec.type]
    return None if importlib.util.find_spec(module) is not None else module


def build_sink(spec: Tracker, run_id: str, run_dir: Path) -> Sink:
    """The sink of one `logging.trackers` entry: the one table of tracker kinds."""
    if isinstance(spec, WandbTracker):
        return WandbSink(spec, run_id, run_dir)
    if isinstance(spec, MlflowTracker):
        return MlflowSink(spec, run_id, run_dir)
    return TensorboardSink(run_dir)
