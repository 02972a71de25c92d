"""Training backends: one model + optimizer behind `forward_backward` / `optim_step`.

- `TorchBackend` (`single.py`): one process, CPU or GPU (bf16 autocast on GPU).
- `FSDPBackend` (`fsdp.py`): FSDP2 (`fully_shard`) over every rank of a `torchrun` job
  (gloo on CPU, NCCL on GPU). Rank 0 runs the service and leads; the other ranks follow
  the commands it broadcasts as tensors.

A Megatron-core backend would implement the same methods.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from treadle_trainer.backends.single import AdamParams, BackendSpec, TorchBackend

T = TypeVar("T")
_TORCH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")


async def on_torch_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run backend work on the process's one torch thread.

    One thread, always the same: OpenMP keeps a team of worker threads per calling thread,
    and the idle team of a second caller spins on the cores the active one needs. It also
    keeps FSDP commands from rank 0 in order.
    """
    return await asyncio.get_running_loop().run_in_executor(_TORCH_THREAD, fn, *args)


def build_backend(spec: BackendSpec) -> TorchBackend:
    """FSDP when this process is part of a multi-rank `torchrun` job, else single-process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from treadle_trainer.backends.fsdp import FSDPBackend

        return FSDPBackend.lead(spec)
    return TorchBackend(spec)


__all__ = ["AdamParams", "BackendSpec", "TorchBackend", "build_backend", "on_torch_thread"]
