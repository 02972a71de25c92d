"""What Treadle's trainer offers code outside the service (the benchmarks, extensions): a
backend (`build_backend`), one training step over a batch (`train_batch`), the batch and loss
types, group advantages, the task seeds of a run, the Tinker adapters, and the replay of a
run's recorded schedule (`replay`, `diff`). Anything else in
`treadle_trainer` is internal and may change; `make lint` holds the benchmarks to this module.
"""

from treadle_trainer.backends import AdamParams, BackendSpec, build_backend
from treadle_trainer.batches import Datum, group_advantages
from treadle_trainer.losses import LossParams
from treadle_trainer.replay import DiffReport, ReplayReport, diff, replay
from treadle_trainer.run import task_seed
from treadle_trainer.tinker.adapters import BaseModel, LoraClient, TinkerDatum
from treadle_trainer.train import train_batch

__all__ = [
    "AdamParams",
    "BackendSpec",
    "BaseModel",
    "Datum",
    "DiffReport",
    "LoraClient",
    "LossParams",
    "ReplayReport",
    "TinkerDatum",
    "build_backend",
    "diff",
    "group_advantages",
    "replay",
    "task_seed",
    "train_batch",
]
