"""Rank 0 leads, ranks 1..N of a `torchrun` job follow: the command protocol every
multi-rank backend (FSDP2, megatron-core) shares.

    torchrun --nproc-per-node N -m treadle_trainer
      rank 0     the trainer service; its backend calls broadcast a command first
      rank 1..N  `follow()`: receive a command, run the same method on their part

Commands travel as tensors (a JSON header as uint8, then the micro-batch tensors), never as
pickled objects. `build` carries the `BackendSpec`, so followers build the backend the
leader chose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from treadle_trainer.backends.group import init_distributed
from treadle_trainer.backends.single import AdamParams, TorchBackend
from treadle_trainer.backends.spec import BackendSpec
from treadle_trainer.batches import MicroBatch
from treadle_trainer.losses import LossParams

_FLOAT_FIELDS = {"mask_B_T", "advantages_B_T", "logprobs_B_T", "coef_B"}


def ping() -> None:
    """Rank 0, on the torch thread between commands: tell the followers it is alive."""
    if dist.is_initialized() and dist.get_rank() == 0:
        _send("ping", {})


class RankedBackend(TorchBackend):
    """A backend whose every method rank 0 first broadcasts as a command (`_lead`), so the
    followers run the same method on their part. Subclasses distribute the model."""

    dp_rank = 0
    """This rank's place among the ranks that split the micro-batches (data parallel)."""
    dp_size = 1
    dp_group: Any = None
    """Their process group (None: every rank)."""

    def __init__(self, spec: BackendSpec):
        self._comm_device = "cuda" if torch.cuda.is_available() else "cpu"
        self._muted = False
        super().__init__(spec)

    def _assign(self, mbs: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """Micro-batches dealt round-robin over the data-parallel ranks; a rank with fewer
        runs zero-weight fillers, so every rank runs the same collectives."""
        rounds = -(-len(mbs) // self.dp_size)
        mine = []
        for r in range(rounds):
            i = r * self.dp_size + self.dp_rank
            mine.append((mbs[i], True) if i < len(mbs) else (mbs[0], False))
        return mine

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self._comm_device)
        dist.all_reduce(values, group=self.dp_group)
        return values.cpu()

    def _max(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self._comm_device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.dp_group)
        return values.cpu()

    @classmethod
    def lead(cls, spec: BackendSpec) -> RankedBackend:
        """Rank 0: tell the followers to build the same backend, then build ours."""
        init_distributed()
        _send("build", spec.model_dump())
        return cls(spec)

    # --- leader side: broadcast the command, then run the same method locally -----------------
    def _lead(self, op: str, header: dict[str, Any], tensors: list[torch.Tensor] | None = None):
        if self.rank == 0 and not self._muted:
            _send(op, header, tensors)

    @contextmanager
    def _mute(self) -> Iterator[None]:
        """Nested calls (save -> state_dict_cpu) must not broadcast a second command."""
        self._muted = True
        try:
            yield
        finally:
            self._muted = False

    def forward_backward(
        self, mbs: list[MicroBatch], loss: str, params: LossParams
    ) -> dict[str, float]:
        header = {
            "loss": loss,
            "params": params.model_dump(),
            "shapes": [list(mb.input_ids_B_T.shape) for mb in mbs],
        }
        self._lead("forward_backward", header, [t for mb in mbs for t in mb.tensors()])
        return super().forward_backward(mbs, loss, params)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self._lead("optim_step", adam.model_dump())
        return super().optim_step(adam)

    def zero_grad(self) -> None:
        self._lead("zero_grad", {})
        super().zero_grad()

    def snapshot_proximal(self) -> None:
        self._lead("snapshot_proximal", {})
        super().snapshot_proximal()

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        self._lead("state_dict", {})
        return super().state_dict_cpu()

    def snapshot_cpu(self) -> dict[str, torch.Tensor]:
        return self.state_dict_cpu()  # gathered from the shards: already a copy

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        self._lead("save", {"path": str(path), "meta": meta})
        with self._mute():
            super().save(path, meta)

    def load(self, path: Path) -> dict[str, Any]:
        self._lead("load", {"path": str(path)})
        return super().load(path)

    def close(self) -> None:
        self._lead("close", {})

    # --- follower side: the same methods, on rank != 0 they do not broadcast -------------------
    def run_command(self, op: str, header: dict[str, Any]) -> bool:
        """Run one command received from rank 0; False when told to stop."""
        if op == "forward_backward":
            mbs = _recv_micro_batches(header["shapes"], self._comm_device)
            self.forward_backward(mbs, header["loss"], LossParams(**header["params"]))
        elif op == "optim_step":
            self.optim_step(AdamParams(**header))
        elif op == "zero_grad":
            self.zero_grad()
        elif op == "snapshot_proximal":
            self.snapshot_proximal()
        elif op == "state_dict":
            self.state_dict_cpu()
        elif op == "save":
            self.save(Path(header["path"]), header["meta"])
        elif op == "load":
            self.load(Path(header["path"]))
        elif op == "close":
            return False
        else:
            raise ValueError(f"unknown command {op!r}")
        return True


# --- the wire: JSON header + tensors, all by broadcast from rank 0 ------------------------------


def _send(op: str, header: dict[str, Any], tensors: list[torch.Tensor] | None = None) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = json.dumps({"op": op, **header}).encode()
    dist.broadcast(torch.tensor([len(raw)], dtype=torch.long, device=device), src=0)
    dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), src=0)
    for t in tensors or []:
        dist.broadcast(t.contiguous().to(device), src=0)


def receive(device: str) -> tuple[str, dict[str, Any]]:
    size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(raw, src=0)
    header = json.loads(bytes(raw.cpu().tolist()))
    return header.pop("op"), header


def _recv_micro_batches(shapes: list[list[int]], device: str) -> list[MicroBatch]:
    mbs = []
    for b, t in shapes:
        tensors = []
        for name in MicroBatch.FIELDS:
            shape = (b, t) if name.endswith("_B_T") else (b,)  # coef_B, staleness_B
            dtype = torch.float32 if name in _FLOAT_FIELDS else torch.long
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=0)
            tensors.append(tensor.cpu())
        mbs.append(MicroBatch(*tensors))
    return mbs


def shutdown_followers() -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        _send("shutdown", {})
        dist.barrier()
        dist.destroy_process_group()
