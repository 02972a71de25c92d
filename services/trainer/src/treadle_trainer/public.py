"""What Treadle's trainer offers code outside the service (the benchmarks, extensions): a
backend (`build_backend`), one training step over a batch (`train_batch`), the batch and loss
types, group advantages, the task seeds of a run, the Tinker adapters, the replay of a
run's recorded schedule (`replay`, `diff`), and the step's group assembly and batch
(`GroupBuffer`, `build_batch`: what `treadle sim` drives in simulated time), the check
of every trajectory read (`invalid_reason`: what `treadle bench capacity` measures), the
service's settings (`TrainerSettings`: what a bench's baseline matches) and a step under
torch.profiler (`profiled`, `phase`: what `bench trainer --profile-dir` compares).
Anything else in `treadle_trainer` is internal and may change; `make lint` holds the
benchmarks to this module.
"""

from treadle_trainer.backends import AdamParams, BackendSpec, build_backend
from treadle_trainer.batches import (
    Datum,
    Entry,
    Group,
    GroupBuffer,
    group_advantages,
    invalid_reason,
)
from treadle_trainer.losses import LossParams
from treadle_trainer.profiling import phase, profiled
from treadle_trainer.replay import DiffReport, ReplayReport, diff, replay
from treadle_trainer.run import task_seed
from treadle_trainer.run.step import Batch, build_batch
from treadle_trainer.settings import TrainerSettings
from treadle_trainer.tinker.adapters import BaseModel, LoraClient, TinkerDatum
from treadle_trainer.train import train_batch

__all__ = [
    "AdamParams",
    "BackendSpec",
    "BaseModel",
    "Batch",
    "Datum",
    "DiffReport",
    "Entry",
    "Group",
    "GroupBuffer",
    "LoraClient",
    "LossParams",
    "ReplayReport",
    "TinkerDatum",
    "TrainerSettings",
    "build_backend",
    "build_batch",
    "diff",
    "group_advantages",
    "invalid_reason",
    "phase",
    "profiled",
    "replay",
    "task_seed",
    "train_batch",
]
