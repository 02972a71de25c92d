"""The one table of training backends: a `BackendSpec` names one, `build_backend` builds it
on the service's rank (refusing what this trainer's ranks cannot run), `build_follower` on the
other ranks of a `torchrun` job. Adding a backend is one entry here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from treadle_common.config.recipe import TrainerBackend
from treadle_trainer.backends.single import TorchBackend
from treadle_trainer.backends.spec import BackendSpec

if TYPE_CHECKING:
    from treadle_trainer.backends.ranks import RankedBackend


def world_size() -> int:
    """Ranks in this trainer's `torchrun` job (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_backend(
    kind: TrainerBackend, tensor_parallel: int, pipeline_parallel: int, lora: bool = False
) -> None:
    """Refuse, with the reason, a backend this trainer's ranks cannot run."""
    ranks = world_size()
    if lora and (kind in ("fsdp", "megatron") or ranks > 1):
        raise ValueError(
            f"trainer.lora trains in one process (backend single); this trainer has {ranks} "
            f"rank(s) and the recipe asks for backend {kind}"
        )
    if kind == "single" and ranks > 1:
        raise ValueError(f"backend single runs in one process; this trainer has {ranks} ranks")
    if kind != "megatron" and (tensor_parallel, pipeline_parallel) != (1, 1):
        raise ValueError("tensor_parallel and pipeline_parallel need backend megatron")
    model_parallel = tensor_parallel * pipeline_parallel
    if kind == "megatron" and ranks % model_parallel:
        raise ValueError(
            f"backend megatron with tensor_parallel={tensor_parallel} x pipeline_parallel="
            f"{pipeline_parallel} needs a multiple of {model_parallel} ranks; this trainer "
            f"has {ranks} (start it with torchrun --nproc-per-node {model_parallel}, or "
            f"treadle up --trainer-ranks {model_parallel})"
        )


def _lora() -> type[TorchBackend]:
    from treadle_trainer.backends.lora import LoraBackend

    return LoraBackend


def _fsdp() -> type[RankedBackend]:
    from treadle_trainer.backends.fsdp import FSDPBackend

    return FSDPBackend


def _megatron() -> type[RankedBackend]:
    from treadle_trainer.backends.megatron import MegatronBackend

    return MegatronBackend


SINGLE_PROCESS: dict[str, Callable[[], type[TorchBackend]]] = {
    "single": lambda: TorchBackend,
    "lora": _lora,
}
"""Backends of one process: name -> its class (imported when first asked for)."""
MULTI_RANK: dict[str, Callable[[], type[RankedBackend]]] = {"fsdp": _fsdp, "megatron": _megatron}
"""Backends over every rank of a `torchrun` job: rank 0 builds with `lead`, which tells the
followers (`follower.py`) to build the same one with `build_follower`."""


def resolve(spec: BackendSpec) -> str:
    """The backend `spec` names: `lora` for an adapter; `auto` is FSDP2 when this process is
    rank 0 of a multi-rank `torchrun` job, else single-process."""
    if spec.lora is not None:
        return "lora"
    if spec.kind == "auto":
        return "fsdp" if world_size() > 1 else "single"
    return spec.kind


def build_backend(spec: BackendSpec) -> TorchBackend:
    """Rank 0 (the service): the backend `spec` names, refused with the reason if this
    trainer's ranks cannot run it."""
    check_backend(spec.kind, spec.tensor_parallel, spec.pipeline_parallel, spec.lora is not None)
    name = resolve(spec)
    if name in MULTI_RANK:
        return MULTI_RANK[name]().lead(spec)
    return SINGLE_PROCESS[name]()(spec)


def build_follower(spec: BackendSpec) -> RankedBackend:
    """Ranks 1..N: their part of the multi-rank backend rank 0 built."""
    return MULTI_RANK[resolve(spec)]()(spec)
