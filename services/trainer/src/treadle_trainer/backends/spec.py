"""`BackendSpec`: what a backend is built from (the model, its kind and parallelism, LoRA)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from treadle_common.config.recipe import TrainerBackend, TrainerConfig


class BackendSpec(BaseModel):
    model_dir: str
    kind: TrainerBackend = Field(
        "auto", description="auto: FSDP2 under a multi-rank torchrun job, else single"
    )
    tensor_parallel: int = Field(1, ge=1, description="megatron: tensor-parallel ranks")
    pipeline_parallel: int = Field(1, ge=1, description="megatron: pipeline stages")
    seed: int = 0
    reference: bool = Field(False, description="Keep a frozen copy for the KL penalty")
    bf16: bool = Field(True, description="bf16 compute on GPU (ignored on CPU)")
    device: str | None = None
    lora: dict[str, Any] | None = Field(
        None, description="Train a LoRA adapter (`LoraSettings` fields): `LoraBackend`"
    )

    @classmethod
    def of(cls, trainer: TrainerConfig, model_dir: str) -> BackendSpec:
        """A run's backend, as its recipe's `trainer` section asks for it."""
        return cls(
            model_dir=model_dir,
            seed=trainer.seed,
            reference=trainer.kl_coef > 0,
            bf16=trainer.bf16,
            kind=trainer.backend,
            tensor_parallel=trainer.tensor_parallel,
            pipeline_parallel=trainer.pipeline_parallel,
            lora=trainer.lora.model_dump() if trainer.lora else None,
        )
