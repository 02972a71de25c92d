"""Training sessions: the caller owns the loop (forward_backward, optim_step, save, load),
each session a model and its optimizer on this trainer. No HTTP here: the edge is
`api_router.py`; refusals are `treadle_trainer.errors`.

A datum is one sequence: `model_input` tokens and per-position `target_tokens`, `weights`
(loss mask), `advantages` and sampling `logprobs`, the loss inputs Tinker names. Losses are
the trainer's (`losses.py`); aggregation defaults to a plain sum as in Tinker. Clients name
server paths only inside the trainer's roots (`paths.confine`); at most `max_sessions` are
open at once (a session being built counts), each its creator's owner's (the core,
`core.py`). With Redis, saving weights that would change the base model of active runs is
refused.
"""

from __future__ import annotations

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
from treadle_trainer import errors, off_policy
from treadle_trainer.backends import BackendSpec, TorchBackend, build_backend
from treadle_trainer.backends.checkpoint_files import verify_checkpoint
from treadle_trainer.batches import Datum, pack
from treadle_trainer.paths import confine
from treadle_trainer.run import claims
from treadle_trainer.training.core import Trainables

DRIFT_FIELDS = (
    "log_ratio_mean",
    "log_ratio_abs_mean",
    "log_ratio_p99",
    "log_ratio_max",
    "behaviour_kl",
    "ratio_histogram",
)
"""A forward_backward's train-inference drift (`consistency.py`): reported only for data
that carried behaviour logprobs."""


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
class FullWeights:
    """A session's model: every weight trained (`TorchBackend`), the weight-store versions
    its `save_weights` published."""

    request: CreateSession
    backend: TorchBackend
    root: Path
    steps: int = 0
    versions: list[int] = field(default_factory=list)

    def close(self) -> None:
        self.backend.close()

    def optim_step(self, adam: AdamParams) -> OptimStepResult:
        out = self.backend.optim_step(adam)
        self.steps += 1
        return OptimStepResult(grad_norm=out["grad_norm"], step=self.steps)

    def load(self, path: Path) -> LoadedState:
        verify_checkpoint(path)
        self.steps = int(self.backend.load(path).get("step", 0))
        return LoadedState(step=self.steps)


class TrainingSessions:
    """`/v1/training` over the training-session core (`core.Trainables`): a session is one
    full-weight model, its creator's owner's."""

    def __init__(
        self,
        store: WeightStoreClient,
        state_dir: Path,
        roots: list[Path],
        max_sessions: int = 4,
        redis: aioredis.Redis | None = None,
    ):
        self.store, self.state_dir, self.roots, self.redis = store, state_dir, roots, redis
        self.models: Trainables[FullWeights] = Trainables(
            "training session",
            max_sessions,
            "TREADLE_TRAINER_MAX_TRAINING_SESSIONS",
            "delete one",
        )

    async def create(self, request: CreateSession) -> SessionCreated:
        confine(request.model_path, self.roots, "model_path")
        if not (Path(request.model_path) / "config.json").exists():
            raise errors.BadRequest(f"{request.model_path} is not an HF model directory")
        sid = uuid.uuid4().hex[:12]
        self.models.reserve(sid)
        spec = BackendSpec(
            model_dir=request.model_path, seed=request.seed, reference=request.kl_reference
        )
        root = self.state_dir / "training" / sid
        model = await self.models.build(
            sid, lambda: FullWeights(request, build_backend(spec), root)
        )
        return SessionCreated(session_id=sid, vocab_size=model.backend.vocab_size)

    async def forward_backward(self, sid: str, request: ForwardBackward) -> ForwardBackwardResult:
        backend = self.models.get(sid).backend
        vocab = backend.vocab_size
        for i, d in enumerate(request.data):
            if any(not 0 <= t < vocab for t in (*d.model_input, *d.target_tokens)):
                raise errors.InvalidInput(f"data[{i}]: token ids must be in 0..{vocab - 1}")
        if request.loss_params.kl_coef > 0 and backend.reference is None:
            raise errors.InvalidInput("kl_coef > 0 needs a session created with kl_reference")
        if off_policy.corrects(request.loss_params.off_policy, request.loss_fn) and any(
            d.logprobs is None for d in request.data
        ):
            raise errors.InvalidInput(
                "loss_params.off_policy corrects against the data's "
                "logprobs: every datum needs them"
            )
        data = [to_datum(d) for d in request.data]
        mbs = pack(data, request.micro_batch_tokens, request.aggregation, backend.pad_id)
        out = await self.models.run(
            sid, lambda m: m.backend.forward_backward(mbs, request.loss_fn, request.loss_params)
        )
        if all(d.logprobs is None for d in request.data):  # no behaviour: no drift to report
            out = {k: v for k, v in out.items() if k not in DRIFT_FIELDS}
        return ForwardBackwardResult(**out)

    async def optim_step(self, sid: str, adam: AdamParams) -> OptimStepResult:
        return await self.models.run(sid, lambda m: m.optim_step(adam))

    async def save_weights(self, sid: str) -> SavedWeights:
        """Publish the session's weights to the weight store (rollout swaps them in)."""
        model = self.models.get(sid)
        state = await self.models.run(sid, lambda m: m.backend.state_dict_cpu())
        raw = state_dict_to_raw(state)
        name = model.request.model_name
        if self.redis is not None and (
            why := await claims.base_change_refused(self.redis, self.store, name, raw)
        ):
            raise errors.Conflict(why)
        response = await self.store.publish(
            name,
            raw,
            trainer_step=model.steps,
            parent_version=model.versions[-1] if model.versions else -1,
            assets=model_assets(Path(model.request.model_path)),
            metadata={"training_session": sid},
        )
        model.versions.append(response.version)
        return SavedWeights(version=response.version, bytes_sent=response.bytes_received)

    async def save_state(self, sid: str, name: str | None) -> SavedState:
        model = self.models.get(sid)
        path = model.root / (name or f"step-{model.steps:06d}")
        await self.models.run(sid, lambda m: m.backend.save(path, {"step": m.steps}))
        return SavedState(path=str(path.resolve()), step=model.steps)

    async def load_state(self, sid: str, where: str) -> LoadedState:
        """Model and optimizer from a checkpoint (whole, and of this model, or refused)."""
        self.models.get(sid)
        path = confine(where, self.roots, "path")
        if not (path / "meta.json").exists():
            raise errors.NotFound(f"no checkpoint at {path}")
        return await self.models.run(sid, lambda m: m.load(path))

    async def delete(self, sid: str) -> None:
        self.models.get(sid)  # 404, or 403 for another owner's
        await self.models.drop(sid)
