"""Training backends: one model + optimizer behind `forward_backward` / `optim_step`.

- `TorchBackend` (`single.py`): one process, CPU or GPU (bf16 autocast on GPU).
- `FSDPBackend` (`fsdp.py`): FSDP2 (`fully_shard`) over every rank of a `torchrun` job
  (gloo on CPU, NCCL on GPU).
- `MegatronBackend` (`megatron/`): megatron-core's `GPTModel`, tensor x pipeline x data
  parallel over the ranks of a `torchrun` job; weights in and out in HF layout.
- `LoraBackend` (`lora.py`): one process, a LoRA adapter on the frozen base model.

Under torchrun, rank 0 runs the service and leads; the other ranks follow the commands it
broadcasts as tensors (`ranks.py`, `follower.py`). `factory.py` is the one table of backends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from treadle_trainer.backends.factory import build_backend, check_backend, world_size
from treadle_trainer.backends.single import AdamParams, TorchBackend
from treadle_trainer.backends.spec import BackendSpec

T = TypeVar("T")
_TORCH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
_LANES = 1


def set_torch_lanes(lanes: int) -> None:
    """How many backend calls may run at once (`trainer_torch_lanes`, before any runs): one
    by default. More lets several runs' steps train side by side, each on its own thread;
    with one torch thread each (`torch_threads` 1) they share no OpenMP team, and torch
    releases the GIL inside its ops. A multi-rank job keeps one lane (its commands go to the
    followers in order)."""
    global _TORCH_THREAD, _LANES
    if lanes > 1 and world_size() > 1:
        raise ValueError("trainer_torch_lanes > 1 needs a single-process trainer")
    if lanes != _LANES:
        _TORCH_THREAD, _LANES = ThreadPoolExecutor(lanes, thread_name_prefix="torch"), lanes


async def on_torch_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run backend work on the process's torch thread (one of its lanes, `set_torch_lanes`).

    One thread by default, always the same: OpenMP keeps a team of worker threads per calling
    thread, and the idle team of a second caller spins on the cores the active one needs. It
    also keeps FSDP commands from rank 0 in order. A run's calls run one after another
    (each is awaited), whichever lane takes them.
    """
    return await asyncio.get_running_loop().run_in_executor(_TORCH_THREAD, fn, *args)


__all__ = [
    "AdamParams",
    "BackendSpec",
    "TorchBackend",
    "build_backend",
    "check_backend",
    "on_torch_thread",
    "set_torch_lanes",
    "world_size",
]
