"""Training sessions: the caller owns the loop (forward_backward, optim_step, save, load),
each session a model and its optimizer on this trainer. No HTTP here: the edge is
`api_router.py`; refusals are `treadle_trainer.errors`.

A datum is one sequence: `model_input` tokens and per-position `target_tokens`, `weights`
(loss mask), `advantages` and sampling `logprobs`, the loss inputs Tinker names. Losses are
the trainer's (`losses.py`); aggregation defaults to a plain sum as in Tinker. Clients name
server paths only inside the trainer's roots (`paths.confine`); at most `max_sessions` are
open at once (a session being built counts). With Redis, saving weights that would change
the base model of active runs is refused.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from treadle_common.api.training import (
    AdamParams,
    CreateSession,
    DatumIn,
    ForwardBackward,
    ForwardBackwardResult,
    LoadedState,
    OptimStepResult,
    SavedState,
    SavedWeights,
    SessionCreated,
)
from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_trainer import errors
from treadle_trainer.backends import BackendSpec, TorchBackend, build_backend, on_torch_thread
from treadle_trainer.backends.checkpoint_files import verify_checkpoint
from treadle_trainer.batches import Datum, pack
from treadle_trainer.paths import confine
from treadle_trainer.run import claims


def to_datum(d: DatumIn) -> Datum:
    """A wire datum as the trainer's; omitted per-position fields take their defaults."""
    n = len(d.model_input)
    return Datum(
        input_ids=d.model_input,
        targets=d.target_tokens,
        weights=d.weights if d.weights is not None else [1.0] * n,
        advantages=d.advantages if d.advantages is not None else [0.0] * n,
        logprobs=d.logprobs if d.logprobs is not None else [0.0] * n,
    )


@dataclass
class Session:
    sid: str
    request: CreateSession
    backend: TorchBackend
    root: Path
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    steps: int = 0
    versions: list[int] = field(default_factory=list)


class TrainingSessions:
    def __init__(
        self,
        store: WeightStoreClient,
        state_dir: Path,
        roots: list[Path],
        max_sessions: int = 4,
        redis: aioredis.Redis | None = None,
    ):
        self.store, self.state_dir, self.roots = store, state_dir, roots
        self.max_sessions, self.redis = max_sessions, redis
        self.sessions: dict[str, Session] = {}
        self.opening = 0  # sessions being built (a model load takes a while): they count too

    def get(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise errors.NotFound(f"no training session {sid}")
        return self.sessions[sid]

    async def create(self, request: CreateSession) -> SessionCreated:
        confine(request.model_path, self.roots, "model_path")
        if not (Path(request.model_path) / "config.json").exists():
            raise errors.BadRequest(f"{request.model_path} is not an HF model directory")
        if len(self.sessions) + self.opening >= self.max_sessions:
            raise errors.TooManyRequests(
                f"{len(self.sessions) + self.opening} training sessions are open, the most "
                f"this trainer holds (TREADLE_TRAINER_MAX_TRAINING_SESSIONS="
                f"{self.max_sessions}); delete one"
            )
        spec = BackendSpec(
            model_dir=request.model_path, seed=request.seed, reference=request.kl_reference
        )
        self.opening += 1
        try:
            backend = await on_torch_thread(build_backend, spec)
        finally:
            self.opening -= 1
        sid = uuid.uuid4().hex[:12]
        self.sessions[sid] = Session(sid, request, backend, self.state_dir / "training" / sid)
        return SessionCreated(session_id=sid, vocab_size=backend.vocab_size)

    async def forward_backward(self, sid: str, request: ForwardBackward) -> ForwardBackwardResult:
        session = self.get(sid)
        vocab = session.backend.vocab_size
        for i, d in enumerate(request.data):
            if any(not 0 <= t < vocab for t in (*d.model_input, *d.target_tokens)):
                raise errors.InvalidInput(f"data[{i}]: token ids must be in 0..{vocab - 1}")
        if request.loss_params.kl_coef > 0 and session.backend.reference is None:
            raise errors.InvalidInput("kl_coef > 0 needs a session created with kl_reference")
        mbs = pack(
            [to_datum(d) for d in request.data],
            request.micro_batch_tokens,
            request.aggregation,
            session.backend.pad_id,
        )
        async with session.lock:
            out = await on_torch_thread(
                session.backend.forward_backward, mbs, request.loss_fn, request.loss_params
            )
        return ForwardBackwardResult(**out)

    async def optim_step(self, sid: str, adam: AdamParams) -> OptimStepResult:
        session = self.get(sid)
        async with session.lock:
            out = await on_torch_thread(session.backend.optim_step, adam)
            session.steps += 1
        return OptimStepResult(grad_norm=out["grad_norm"], step=session.steps)

    async def save_weights(self, sid: str) -> SavedWeights:
        """Publish the session's weights to the weight store (rollout swaps them in)."""
        session = self.get(sid)
        async with session.lock:
            state = await on_torch_thread(session.backend.state_dict_cpu)
        raw = state_dict_to_raw(state)
        model = session.request.model_name
        if self.redis is not None and (
            why := await claims.base_change_refused(self.redis, self.store, model, raw)
        ):
            raise errors.Conflict(why)
        response = await self.store.publish(
            model,
            raw,
            trainer_step=session.steps,
            parent_version=session.versions[-1] if session.versions else -1,
            assets=model_assets(Path(session.request.model_path)),
            metadata={"training_session": sid},
        )
        session.versions.append(response.version)
        return SavedWeights(version=response.version, bytes_sent=response.bytes_received)

    async def save_state(self, sid: str, name: str | None) -> SavedState:
        session = self.get(sid)
        path = session.root / (name or f"step-{session.steps:06d}")
        async with session.lock:
            await on_torch_thread(session.backend.save, path, {"step": session.steps})
        return SavedState(path=str(path.resolve()), step=session.steps)

    async def load_state(self, sid: str, where: str) -> LoadedState:
        """Model and optimizer from a checkpoint (whole, and of this model, or refused)."""
        session = self.get(sid)
        path = confine(where, self.roots, "path")
        if not (path / "meta.json").exists():
            raise errors.NotFound(f"no checkpoint at {path}")
        async with session.lock:
            await asyncio.to_thread(verify_checkpoint, path)
            meta = await on_torch_thread(session.backend.load, path)
            session.steps = int(meta.get("step", 0))
        return LoadedState(step=session.steps)

    async def delete(self, sid: str) -> None:
        session = self.get(sid)
        async with session.lock:
            del self.sessions[sid]
            await on_torch_thread(session.backend.close)
