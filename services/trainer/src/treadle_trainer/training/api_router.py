"""`/v1/training`: the HTTP edge of `sessions.py` (models: `treadle_common.api.training`).

POST   /v1/training/sessions                       {model_path, model_name, seed} -> id
POST   /v1/training/sessions/{id}/forward_backward  {loss_fn, data: [Datum], ...} -> stats
POST   /v1/training/sessions/{id}/optim_step        Adam params -> grad norm, step
POST   /v1/training/sessions/{id}/save_weights      -> weight-store version (rollout swaps)
POST   /v1/training/sessions/{id}/save_state        -> checkpoint path
POST   /v1/training/sessions/{id}/load_state        {path} -> step
DELETE /v1/training/sessions/{id}
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from treadle_common.api.training import (
    AdamParams,
    CreateSession,
    ForwardBackward,
    ForwardBackwardResult,
    LoadedState,
    LoadState,
    OptimStepResult,
    SavedState,
    SavedWeights,
    SaveState,
    SessionCreated,
)
from treadle_common.auth import policy as auth
from treadle_trainer.training.sessions import TrainingSessions

router = APIRouter(prefix="/v1/training/sessions", tags=["training"])
ROLES = auth.roles(auth.TRAINER)


def sessions(request: Request) -> TrainingSessions:
    return request.app.state.training_sessions


Sessions = Annotated[TrainingSessions, Depends(sessions)]


@router.post("", status_code=201, openapi_extra=ROLES)
async def create(request: CreateSession, core: Sessions) -> SessionCreated:
    return await core.create(request)


@router.post("/{sid}/forward_backward", openapi_extra=ROLES)
async def forward_backward(
    sid: str, request: ForwardBackward, core: Sessions
) -> ForwardBackwardResult:
    return await core.forward_backward(sid, request)


@router.post("/{sid}/optim_step", openapi_extra=ROLES)
async def optim_step(sid: str, adam: AdamParams, core: Sessions) -> OptimStepResult:
    return await core.optim_step(sid, adam)


@router.post("/{sid}/save_weights", openapi_extra=ROLES)
async def save_weights(sid: str, core: Sessions) -> SavedWeights:
    return await core.save_weights(sid)


@router.post("/{sid}/save_state", openapi_extra=ROLES)
async def save_state(sid: str, request: SaveState, core: Sessions) -> SavedState:
    return await core.save_state(sid, request.name)


@router.post("/{sid}/load_state", openapi_extra=ROLES)
async def load_state(sid: str, request: LoadState, core: Sessions) -> LoadedState:
    return await core.load_state(sid, request.path)


@router.delete("/{sid}", status_code=204, openapi_extra=ROLES)
async def delete(sid: str, core: Sessions) -> None:
    await core.delete(sid)
