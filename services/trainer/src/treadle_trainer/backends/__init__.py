"""Training backends: one model + optimizer behind `forward_backward` / `optim_step`.

- `TorchBackend` (`single.py`): one process, CPU or GPU (bf16 autocast on GPU).
- `FSDPBackend` (`fsdp.py`): FSDP2 (`fully_shard`) over every rank of a `torchrun` job
  (gloo on CPU, NCCL on GPU). Rank 0 runs the service and leads; the other ranks follow
  the commands it broadcasts as tensors.

A Megatron-core backend would implement the same methods.
"""

from __future__ import annotations

import os

from treadle_trainer.backends.single import AdamParams, BackendSpec, TorchBackend


def build_backend(spec: BackendSpec) -> TorchBackend:
    """FSDP when this process is part of a multi-rank `torchrun` job, else single-process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from treadle_trainer.backends.fsdp import FSDPBackend

        return FSDPBackend.lead(spec)
    return TorchBackend(spec)


__all__ = ["AdamParams", "BackendSpec", "TorchBackend", "build_backend"]
