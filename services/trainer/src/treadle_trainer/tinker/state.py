"""What the Tinker surface holds between requests (`TinkerState`), and who owns it.

Everything a session makes is named after it (`<session>:train:<seq>`, `<session>:sample:<seq>`)
and belongs to the tenant that created the session (`auth.caller()`); checkpoints carry their
tenant in `meta.json`. A tenant's token that names another tenant's session, client, sampler,
future or checkpoint is refused with 403; `admin` sees every tenant's. The training clients
live in the trainer's training-session core (`training/core.py`: the limit, ownership, one
call at a time per client), the one `/v1/training` uses too.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle_common.auth import policy as auth
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.runtime.logs import get_logger
from treadle_trainer import errors
from treadle_trainer.backends import on_torch_thread
from treadle_trainer.errors import InvalidInput
from treadle_trainer.tinker.adapters import BaseModel, LoraClient
from treadle_trainer.tinker.checkpoints import read_meta
from treadle_trainer.tinker.futures import Futures, Result
from treadle_trainer.tinker.sampling import RolloutSampler, Sampler, SamplerWeights
from treadle_trainer.training.core import Trainables

ROLES = auth.roles(auth.TINKER)
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
log = get_logger(__name__)
TINKER_PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")


@dataclass
class TinkerState:
    models: dict[str, str]
    """Base-model name -> HF directory (`TREADLE_TRAINER_TINKER_MODELS`)."""
    root: Path
    store: WeightStoreClient
    max_clients: int
    rollout: RolloutSampler | None
    bases: dict[str, BaseModel] = field(default_factory=dict)
    clients: Trainables[LoraClient] = field(init=False)
    """The training clients, `<session>:train:<seq>`, in the training-session core."""
    session_ttl_s: float = 300.0
    sessions: dict[str, float] = field(default_factory=dict)
    """Open sessions -> when the last heartbeat (or creation) was seen (monotonic)."""
    tenants: dict[str, str] = field(default_factory=dict)
    """Open sessions -> the owner that created them (`auth.Identity.owner`: its tenant, or
    a Tinker key's own)."""
    sampler_weights: dict[str, SamplerWeights] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: Futures = field(default_factory=Futures)
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.clients = Trainables(
            "training client",
            self.max_clients,
            "TREADLE_TRAINER_TINKER_MAX_CLIENTS",
            "end a session that holds one",
        )

    # --- ownership --------------------------------------------------------------------------
    def owned(self, name: str) -> str:
        """`name` (a session id, or an id made in one) if the caller may use it, else 403."""
        session_id = name.split(":", 1)[0]
        auth.refuse_unless_owns(self.tenants.get(session_id), f"tinker session {session_id!r}")
        return name

    def session(self, session_id: str) -> str:
        if session_id not in self.sessions:
            raise errors.NotFound(f"no session {session_id!r} (create_session first)")
        return self.owned(session_id)

    # --- sessions ---------------------------------------------------------------------------
    async def open_session(self) -> str:
        """A new session, the caller's owner's."""
        await self.reap()
        session_id = uuid.uuid4().hex[:16]
        self.sessions[session_id] = time.monotonic()
        self.tenants[session_id] = auth.caller().owner
        return session_id

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise errors.Gone(f"session {session_id} has finished")
        self.owned(session_id)
        self.sessions[session_id] = time.monotonic()

    async def end_session(self, session_id: str) -> None:
        """Its training clients and their adapters go (saved checkpoints and published
        sampler weights stay); a client still being built is closed when it is done."""
        self.sessions.pop(session_id, None)
        self.tenants.pop(session_id, None)
        for model_id in self.clients.keys(f"{session_id}:"):
            self.futures.forget(model_id)
            await self.clients.drop(model_id)

    async def reap(self) -> None:
        """End the sessions whose SDK stopped heartbeating (it beats every 10 s) more than
        `session_ttl_s` ago: a script that died frees its adapters."""
        cutoff = time.monotonic() - self.session_ttl_s
        for session_id in [s for s, seen in self.sessions.items() if seen < cutoff]:
            log.info("tinker session expired", session=session_id)
            await self.end_session(session_id)

    # --- models, clients, samplers ----------------------------------------------------------
    async def new_model_id(self, session_id: str, seq: int) -> str:
        """The id of a session's `seq`-th training client, reserved (while it is built) if the
        session may have one more."""
        await self.reap()
        self.session(session_id)
        model_id = f"{session_id}:train:{seq}"
        self.clients.reserve(model_id)
        return model_id

    def check_served(self, name: str) -> None:
        if name not in self.models:
            known = ", ".join(sorted(self.models)) or "none (set TREADLE_TRAINER_TINKER_MODELS)"
            raise errors.InvalidInput(f"base model {name!r} is not served here; served: {known}")

    async def base(self, name: str) -> BaseModel:
        async with self.loading:
            if name not in self.bases:
                self.bases[name] = await on_torch_thread(BaseModel, name, self.models[name])
        return self.bases[name]

    def client(self, model_id: str) -> LoraClient:
        return self.clients.get(self.owned(model_id))

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise errors.NotFound(f"no sampler {sampler_id!r}")
        return self.samplers[self.owned(sampler_id)]

    # --- checkpoints ------------------------------------------------------------------------
    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id.replace(":", "_") / kind / name

    def resolve(self, path: str, kind: str = "weights") -> Path:
        """The directory of a `tinker://<model id>/weights/<name>` checkpoint (403 if another
        tenant's)."""
        match = TINKER_PATH.match(path)
        if not match or match.group(2) != kind:
            raise InvalidInput(f"{path!r} is not a tinker://<model id>/{kind}/<name> path")
        directory = self.checkpoint_dir(match.group(1), kind, match.group(3))
        if not (directory / "meta.json").exists():
            raise InvalidInput(f"no checkpoint at {path}")
        meta = read_meta(directory)
        auth.refuse_unless_owns(meta.get("owner", meta.get("tenant")), f"checkpoint {path}")
        return directory

    def sampler_weights_of(self, path: str) -> SamplerWeights:
        directory = self.resolve(path, "sampler_weights")  # checks the tenant, every time
        if path not in self.sampler_weights:
            meta = read_meta(directory)  # after a restart
            self.sampler_weights[path] = SamplerWeights(
                meta["base_model"], meta["store_model"], meta["version"]
            )
        return self.sampler_weights[path]

    # --- futures ----------------------------------------------------------------------------
    def submit(self, work: Any, queue: str, seq_id: int | None = None, **kw: Any) -> str:
        """`Futures.submit` in the caller's tenant (its request ids are the tenant's)."""
        return self.futures.submit(work, queue, seq_id, tenant=auth.caller().owner, **kw)


def json_result(result: Any) -> Result:
    return Result(json=result.model_dump(mode="json", exclude_none=True))


def checkpoint_name(name: str | None, client: LoraClient) -> str:
    name = name or f"step-{client.steps:06d}-{uuid.uuid4().hex[:6]}"
    if not CHECKPOINT_NAME.match(name) or ".." in name:
        raise InvalidInput(f"checkpoint name {name!r}: letters, digits, '.', '_', '-' only")
    return name
