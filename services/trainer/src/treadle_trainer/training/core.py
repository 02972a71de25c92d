"""The training-session core: models a caller trains step by step on this trainer (the caller
owns the loop), under two adapters that only translate:

    /v1/training   `training/sessions.py`: a full-weight model per session (`TorchBackend`)
    Tinker         `tinker/`: LoRA adapters on one shared frozen base per base model

    Trainable      what the core needs of a held model: `close()`; everything else the
                   adapter asks of it runs through `Trainables.run`
    Trainables     every model held: at most `limit` at once (one being built counts), each
                   its creator's owner's (`auth.Identity.owner`: another tenant's or key's id is
                   refused with 403; admin sees all), built, worked on and closed on the
                   trainer's torch thread, one call at a time per model, in arrival order

No HTTP here: refusals are `treadle_trainer.errors`, mapped at the edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from treadle_common.auth import policy as auth
from treadle_trainer import errors
from treadle_trainer.backends import on_torch_thread


class Trainable(Protocol):
    def close(self) -> None: ...


M = TypeVar("M", bound=Trainable)
R = TypeVar("R")


@dataclass
class Held(Generic[M]):
    owner: str
    model: M | None = None
    """None while it is being built."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Trainables(Generic[M]):
    def __init__(self, what: str, limit: int, setting: str, free: str):
        """`what` names a model in refusals ("training session"); `setting` is the one that
        sets `limit` and `free` how a caller frees a place, both named when the trainer is
        full."""
        self.what, self.limit, self.setting, self.free = what, limit, setting, free
        self.held: dict[str, Held[M]] = {}

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, key: str) -> bool:
        return key in self.held

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.held if k.startswith(prefix)]

    def reserve(self, key: str) -> None:
        """Hold `key` for the caller's owner while its model is built (it counts)."""
        if key in self.held:
            raise errors.Conflict(f"{self.what} {key} exists")
        if len(self.held) >= self.limit:
            raise errors.TooManyRequests(
                f"{len(self.held)} {self.what}s are open, the most this trainer holds "
                f"({self.setting}={self.limit}); {self.free}"
            )
        self.held[key] = Held(auth.caller().owner)

    async def build(self, key: str, make: Callable[..., M], *args: Any) -> M:
        """`make(*args)` on the torch thread, as the model of the reserved `key`. If it fails,
        the reservation goes; if `key` was dropped meanwhile, the model is closed (refused)."""
        try:
            model = await on_torch_thread(make, *args)
        except BaseException:
            self.held.pop(key, None)
            raise
        held = self.held.get(key)
        if held is None:
            await on_torch_thread(model.close)
            raise errors.InvalidInput(f"{self.what} {key} was deleted while it was built")
        held.model = model
        return model

    def get(self, key: str) -> M:
        """The model of `key`, if it is built and the caller may use it (else 404 / 403)."""
        held = self.held.get(key)
        if held is None or held.model is None:
            raise errors.NotFound(f"no {self.what} {key}")
        auth.refuse_unless_owns(held.owner, f"{self.what} {key!r}")
        return held.model

    async def run(self, key: str, work: Callable[[M], R]) -> R:
        """`work(model)` on the torch thread, after the model's earlier work."""
        model = self.get(key)
        async with self.held[key].lock:
            return await on_torch_thread(work, model)

    async def drop(self, key: str) -> None:
        """Close and forget `key` (after its running work); one being built is closed when
        its build ends. Ownership is the adapter's to check first (`get`)."""
        held = self.held.get(key)
        if held is None:
            return
        async with held.lock:
            if self.held.get(key) is held:
                del self.held[key]
            if held.model is not None:
                await on_torch_thread(held.model.close)
