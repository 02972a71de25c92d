"""FSDP2 backend: the model sharded with `fully_shard` over every rank of a `torchrun` job.

Rank 0 leads and the other ranks follow (see `ranks.py`). Micro-batches are dealt
round-robin; a rank with fewer runs a zero-weight filler so every rank does the same number
of forward/backward passes (FSDP collectives). FSDP averages gradients over ranks, so each
rank's loss is scaled by the world size to keep the gradient of the batch sum identical to
the single-process backend.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from treadle_trainer.backends.group import init_distributed
from treadle_trainer.backends.ranks import RankedBackend
from treadle_trainer.backends.spec import BackendSpec


class FSDPBackend(RankedBackend):
    share_prefix = False  # see `logprobs.token_logprobs`

    def __init__(self, spec: BackendSpec):
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        if torch.cuda.is_available() and spec.device is None:
            spec = spec.model_copy(update={"device": f"cuda:{torch.cuda.current_device()}"})
        super().__init__(spec)

    def _wrap(self) -> None:
        mesh = init_device_mesh(self.device.split(":")[0], (self.world_size,))
        mp = None
        if self.device.startswith("cuda") and self.spec.bf16:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs: dict[str, Any] = {"mesh": mesh}
        if mp is not None:
            kwargs["mp_policy"] = mp
        self._shard_kwargs = kwargs
        self._shard(self.model)
        if self.reference is not None:
            self._shard(self.reference)

    def _shard(self, model: torch.nn.Module) -> None:
        """fully_shard each decoder block, then the root."""
        blocks = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, **self._shard_kwargs)
        fully_shard(model, **self._shard_kwargs)

    def _wrap_frozen(self, module: torch.nn.Module) -> None:
        self._shard(module)

    def _autocast(self):
        return nullcontext()  # FSDP's MixedPrecisionPolicy casts instead

    @property
    def _grad_scale(self) -> float:
        return float(self.world_size)
