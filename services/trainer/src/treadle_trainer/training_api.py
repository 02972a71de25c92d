"""Tinker-style training API on the trainer's HTTP port: the caller owns the loop.

    POST   /v1/training/sessions                      {model_path, model_name, seed} -> id
    POST   /v1/training/sessions/{id}/forward_backward {loss_fn, data: [Datum], ...} -> stats
    POST   /v1/training/sessions/{id}/optim_step       Adam params -> grad norm, step
    POST   /v1/training/sessions/{id}/save_weights     -> weight-store version (rollout swaps)
    POST   /v1/training/sessions/{id}/save_state       -> checkpoint path
    POST   /v1/training/sessions/{id}/load_state       {path} -> step
    DELETE /v1/training/sessions/{id}

A Datum is one sequence: `model_input` tokens and per-position `target_tokens`, `weights`
(loss mask), `advantages` and sampling `logprobs`, the loss inputs Tinker names. Losses are
the trainer's (`losses.py`); aggregation defaults to a plain sum as in Tinker.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field, model_validator

from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config import LossName
from treadle_trainer.backends import (
    AdamParams,
    BackendSpec,
    TorchBackend,
    build_backend,
    on_torch_thread,
)
from treadle_trainer.backends.single import IncompatibleCheckpoint
from treadle_trainer.batches import Datum, pack
from treadle_trainer.losses import LossParams


class CreateSession(BaseModel):
    model_path: str = Field(description="HF model directory to train")
    model_name: str = Field("tiny", description="Weight-store model name for save_weights")
    seed: int = 0
    kl_reference: bool = Field(False, description="Keep a frozen reference for kl_coef > 0")


class DatumIn(BaseModel):
    model_input: list[int] = Field(min_length=1)
    target_tokens: list[int]
    weights: list[float] | None = None
    advantages: list[float] | None = None
    logprobs: list[float] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> DatumIn:
        n = len(self.model_input)
        for name in ("target_tokens", "weights", "advantages", "logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries, model_input has {n}")
        return self

    def datum(self) -> Datum:
        n = len(self.model_input)
        return Datum(
            input_ids=self.model_input,
            targets=self.target_tokens,
            weights=self.weights if self.weights is not None else [1.0] * n,
            advantages=self.advantages if self.advantages is not None else [0.0] * n,
            logprobs=self.logprobs if self.logprobs is not None else [0.0] * n,
        )


class ForwardBackward(BaseModel):
    loss_fn: LossName = "cross_entropy"
    loss_params: LossParams = Field(default_factory=LossParams)
    aggregation: Literal["token", "sequence", "group", "sum"] = "sum"
    micro_batch_tokens: int = Field(8192, ge=1)
    data: list[DatumIn] = Field(min_length=1)


class LoadState(BaseModel):
    path: str


class SaveState(BaseModel):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")


class Session:
    def __init__(self, sid: str, request: CreateSession, backend: TorchBackend, root: Path):
        self.sid, self.request, self.backend, self.root = sid, request, backend, root
        self.lock = asyncio.Lock()
        self.steps = 0
        self.versions: list[int] = []


def mount(app: FastAPI, store: WeightStoreClient, state_dir: Path) -> None:
    sessions: dict[str, Session] = {}

    def get(sid: str) -> Session:
        if sid not in sessions:
            raise HTTPException(404, f"no training session {sid}")
        return sessions[sid]

    @app.post("/v1/training/sessions", status_code=201, tags=["training"])
    async def create(request: CreateSession) -> dict:
        if not (Path(request.model_path) / "config.json").exists():
            raise HTTPException(400, f"{request.model_path} is not an HF model directory")
        spec = BackendSpec(
            model_dir=request.model_path, seed=request.seed, reference=request.kl_reference
        )
        backend = await on_torch_thread(build_backend, spec)
        sid = uuid.uuid4().hex[:12]
        sessions[sid] = Session(sid, request, backend, state_dir / "training" / sid)
        return {"session_id": sid, "vocab_size": backend.vocab_size}

    @app.post("/v1/training/sessions/{sid}/forward_backward", tags=["training"])
    async def forward_backward(sid: str, request: ForwardBackward) -> dict:
        session = get(sid)
        vocab = session.backend.vocab_size
        for i, d in enumerate(request.data):
            if any(not 0 <= t < vocab for t in (*d.model_input, *d.target_tokens)):
                raise HTTPException(400, f"data[{i}]: token ids must be in 0..{vocab - 1}")
        if request.loss_params.kl_coef > 0 and session.backend.reference is None:
            raise HTTPException(400, "kl_coef > 0 needs a session created with kl_reference")
        mbs = pack(
            [d.datum() for d in request.data],
            request.micro_batch_tokens,
            request.aggregation,
            session.backend.pad_id,
        )
        async with session.lock:
            return await on_torch_thread(
                session.backend.forward_backward, mbs, request.loss_fn, request.loss_params
            )

    @app.post("/v1/training/sessions/{sid}/optim_step", tags=["training"])
    async def optim_step(sid: str, adam: AdamParams) -> dict:
        session = get(sid)
        async with session.lock:
            out = await on_torch_thread(session.backend.optim_step, adam)
            session.steps += 1
        return {**out, "step": session.steps}

    @app.post("/v1/training/sessions/{sid}/save_weights", tags=["training"])
    async def save_weights(sid: str) -> dict:
        session = get(sid)
        async with session.lock:
            state = await on_torch_thread(session.backend.state_dict_cpu)
        response = await store.publish(
            session.request.model_name,
            state_dict_to_raw(state),
            trainer_step=session.steps,
            parent_version=session.versions[-1] if session.versions else -1,
            assets=model_assets(Path(session.request.model_path)),
            metadata={"training_session": sid},
        )
        session.versions.append(response.version)
        return {"version": response.version, "bytes_sent": response.bytes_received}

    @app.post("/v1/training/sessions/{sid}/save_state", tags=["training"])
    async def save_state(sid: str, request: SaveState) -> dict:
        session = get(sid)
        path = session.root / (request.name or f"step-{session.steps:06d}")
        async with session.lock:
            await on_torch_thread(session.backend.save, path, {"step": session.steps})
        return {"path": str(path.resolve()), "step": session.steps}

    @app.post("/v1/training/sessions/{sid}/load_state", tags=["training"])
    async def load_state(sid: str, request: LoadState) -> dict:
        session = get(sid)
        path = Path(request.path)
        if not (path / "meta.json").exists():
            raise HTTPException(404, f"no checkpoint at {path}")
        async with session.lock:
            try:
                meta = await on_torch_thread(session.backend.load, path)
            except IncompatibleCheckpoint as exc:
                raise HTTPException(409, str(exc)) from exc
            session.steps = int(meta.get("step", 0))
        return {"step": session.steps}

    @app.delete("/v1/training/sessions/{sid}", status_code=204, tags=["training"])
    async def delete(sid: str) -> None:
        session = get(sid)
        async with session.lock:
            del sessions[sid]
            await on_torch_thread(session.backend.close)
