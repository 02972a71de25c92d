"""Tinker-style training API on the trainer's HTTP port: the caller owns the loop.

    POST   /v1/training/sessions                      {model_path, model_name, seed} -> id
    POST   /v1/training/sessions/{id}/forward_backward {loss_fn, data: [Datum], ...} -> stats
    POST   /v1/training/sessions/{id}/optim_step       Adam params -> grad norm, step
    POST   /v1/training/sessions/{id}/save_weights     -> weight-store version (rollout swaps)
    POST   /v1/training/sessions/{id}/save_state       -> checkpoint path
    POST   /v1/training/sessions/{id}/load_state       {path} -> step
    DELETE /v1/training/sessions/{id}

The requests and answers are `treadle_common.api.training`'s (a Datum is one sequence:
`model_input` tokens and per-position `target_tokens`, `weights` (loss mask), `advantages` and
sampling `logprobs`, the loss inputs Tinker names). Losses are the trainer's (`losses.py`);
aggregation defaults to a plain sum as in Tinker.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import redis.asyncio as aioredis
from fastapi import FastAPI, HTTPException

from treadle_common import auth
from treadle_common.api.training import (
    AdamParams,
    CreateSession,
    DatumIn,
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
from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_trainer.backends import (
    BackendSpec,
    TorchBackend,
    build_backend,
    on_torch_thread,
)
from treadle_trainer.backends.checkpoint_files import (
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    verify_checkpoint,
)
from treadle_trainer.batches import Datum, pack
from treadle_trainer.paths import confine
from treadle_trainer.run import claims


def _datum(d: DatumIn) -> Datum:
    """A wire datum as the trainer's; omitted per-position fields take their defaults."""
    n = len(d.model_input)
    return Datum(
        input_ids=d.model_input,
        targets=d.target_tokens,
        weights=d.weights if d.weights is not None else [1.0] * n,
        advantages=d.advantages if d.advantages is not None else [0.0] * n,
        logprobs=d.logprobs if d.logprobs is not None else [0.0] * n,
    )


class Session:
    def __init__(self, sid: str, request: CreateSession, backend: TorchBackend, root: Path):
        self.sid, self.request, self.backend, self.root = sid, request, backend, root
        self.lock = asyncio.Lock()
        self.steps = 0
        self.versions: list[int] = []


def mount(
    app: FastAPI,
    store: WeightStoreClient,
    state_dir: Path,
    roots: list[Path],
    *,
    max_sessions: int = 4,
    redis: aioredis.Redis | None = None,
) -> None:
    """The training API; clients name server paths only inside `roots` (`paths.confine`);
    at most `max_sessions` sessions (each a model and its optimizer) are open at once. With
    `redis`, saving weights that would change the base model of active runs is refused."""
    sessions: dict[str, Session] = {}
    opening = 0  # sessions being built (a model load takes a while): they count too

    def get(sid: str) -> Session:
        if sid not in sessions:
            raise HTTPException(404, f"no training session {sid}")
        return sessions[sid]

    @app.post(
        "/v1/training/sessions",
        status_code=201,
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def create(request: CreateSession) -> SessionCreated:
        confine(request.model_path, roots, "model_path")
        if not (Path(request.model_path) / "config.json").exists():
            raise HTTPException(400, f"{request.model_path} is not an HF model directory")
        nonlocal opening
        if len(sessions) + opening >= max_sessions:
            raise HTTPException(
                429,
                f"{len(sessions) + opening} training sessions are open, the most this trainer "
                f"holds (TREADLE_TRAINER_MAX_TRAINING_SESSIONS={max_sessions}); delete one",
            )
        spec = BackendSpec(
            model_dir=request.model_path, seed=request.seed, reference=request.kl_reference
        )
        opening += 1
        try:
            backend = await on_torch_thread(build_backend, spec)
        finally:
            opening -= 1
        sid = uuid.uuid4().hex[:12]
        sessions[sid] = Session(sid, request, backend, state_dir / "training" / sid)
        return SessionCreated(session_id=sid, vocab_size=backend.vocab_size)

    @app.post(
        "/v1/training/sessions/{sid}/forward_backward",
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def forward_backward(sid: str, request: ForwardBackward) -> ForwardBackwardResult:
        session = get(sid)
        vocab = session.backend.vocab_size
        for i, d in enumerate(request.data):
            if any(not 0 <= t < vocab for t in (*d.model_input, *d.target_tokens)):
                raise HTTPException(400, f"data[{i}]: token ids must be in 0..{vocab - 1}")
        if request.loss_params.kl_coef > 0 and session.backend.reference is None:
            raise HTTPException(400, "kl_coef > 0 needs a session created with kl_reference")
        mbs = pack(
            [_datum(d) for d in request.data],
            request.micro_batch_tokens,
            request.aggregation,
            session.backend.pad_id,
        )
        async with session.lock:
            out = await on_torch_thread(
                session.backend.forward_backward, mbs, request.loss_fn, request.loss_params
            )
        return ForwardBackwardResult(**out)

    @app.post(
        "/v1/training/sessions/{sid}/optim_step",
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def optim_step(sid: str, adam: AdamParams) -> OptimStepResult:
        session = get(sid)
        async with session.lock:
            out = await on_torch_thread(session.backend.optim_step, adam)
            session.steps += 1
        return OptimStepResult(grad_norm=out["grad_norm"], step=session.steps)

    @app.post(
        "/v1/training/sessions/{sid}/save_weights",
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def save_weights(sid: str) -> SavedWeights:
        session = get(sid)
        async with session.lock:
            state = await on_torch_thread(session.backend.state_dict_cpu)
        raw = state_dict_to_raw(state)
        model = session.request.model_name
        if redis is not None and (
            why := await claims.base_change_refused(redis, store, model, raw)
        ):
            raise HTTPException(409, why)
        response = await store.publish(
            session.request.model_name,
            raw,
            trainer_step=session.steps,
            parent_version=session.versions[-1] if session.versions else -1,
            assets=model_assets(Path(session.request.model_path)),
            metadata={"training_session": sid},
        )
        session.versions.append(response.version)
        return SavedWeights(version=response.version, bytes_sent=response.bytes_received)

    @app.post(
        "/v1/training/sessions/{sid}/save_state",
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def save_state(sid: str, request: SaveState) -> SavedState:
        session = get(sid)
        path = session.root / (request.name or f"step-{session.steps:06d}")
        async with session.lock:
            await on_torch_thread(session.backend.save, path, {"step": session.steps})
        return SavedState(path=str(path.resolve()), step=session.steps)

    @app.post(
        "/v1/training/sessions/{sid}/load_state",
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def load_state(sid: str, request: LoadState) -> LoadedState:
        session = get(sid)
        path = confine(request.path, roots, "path")
        if not (path / "meta.json").exists():
            raise HTTPException(404, f"no checkpoint at {path}")
        async with session.lock:
            try:
                await asyncio.to_thread(verify_checkpoint, path)
                meta = await on_torch_thread(session.backend.load, path)
            except IncompatibleCheckpoint as exc:
                raise HTTPException(409, str(exc)) from exc
            except CorruptCheckpoint as exc:
                raise HTTPException(422, str(exc)) from exc
            session.steps = int(meta.get("step", 0))
        return LoadedState(step=session.steps)

    @app.delete(
        "/v1/training/sessions/{sid}",
        status_code=204,
        tags=["training"],
        openapi_extra=auth.roles(auth.TRAINER),
    )
    async def delete(sid: str) -> None:
        session = get(sid)
        async with session.lock:
            del sessions[sid]
            await on_torch_thread(session.backend.close)
