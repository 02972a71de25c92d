"""Many runs' policies on one engine: LoRA runs served as adapters on this replica's base.

A LoRA run's tasks name its own policy model (`names.adapter_policy(base, run)`); each
version of that model is an adapter over a full-weight version of the base model this
replica serves. `RunPolicies` keeps such policies loaded in the engine as adapters named
after their policy model, so every run's rows share the engine's batches
(`Sampling.adapter`), and tags each token with its own run's version:

    task.model == engine.model_name -> the engine's own policy (`WeightSync`)
    task.model is an adapter policy -> `AdapterPolicy`: the version a task demands (from the
        store, as soon as it is committed) or an announcement names; loaded at the engine's
        pause point; its base must be weights the engine holds (else the task's episodes
        fail as engine errors, saying so)

At most `max_resident` adapter policies stay loaded; the least recently used one is unloaded
to make room (a later task of it loads it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from opentelemetry.context import Context

from treadle_common.clients.torch_weights import fetch_state_dict
from treadle_common.clients.weights import WeightStoreClient, watch
from treadle_common.model import lora
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger
from treadle_rollout.engines.base import Engine

log = get_logger(__name__)


class PolicyError(RuntimeError):
    """A policy version this replica cannot serve (not an adapter of its base weights)."""


class AdapterPolicy:
    """One run's LoRA policy, resident in the engine as the adapter `name`."""

    def __init__(self, name: str, engine: Engine, store: WeightStoreClient, poll_s: float):
        self.name, self.engine, self.store, self.poll_s = name, engine, store, poll_s
        self.version = -1
        """The version loaded (-1: none yet)."""
        self.last_used = time.monotonic()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._announced = -1
        self._subscription: object | None = None
        self.on_fetched: Callable[[str, int], Awaitable[None]] | None = None
        """Told the bytes of each version fetched (usage accounting)."""

    async def ensure(self, version: int) -> None:
        """Until the engine serves at least `version` of this policy."""
        self.last_used = time.monotonic()
        while self.version < version:
            async with self._lock:
                if self.version >= version:
                    return
                latest = await self.store.wait_for_version(self.name, version, self.poll_s)
                if latest is not None and latest >= version:
                    await self._load(latest)

    async def wait_for_newer(self, version: int, timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.version > version), timeout_s
                )
            except TimeoutError:
                return False
        return True

    async def on_announcement(self, ann: pb.WeightAnnouncement) -> None:
        """A newer version was published: load it now (one attempt; an announcement the store
        cannot back is ignored, and a task that demands a version asks the store itself)."""
        if ann.version <= max(self.version, self._announced):
            return
        self._announced = ann.version
        try:
            async with self._lock:
                if self.version < ann.version:
                    await self._load(ann.version)
        except Exception as exc:  # a task that demands it asks the store itself
            log.warning("adapter policy update failed", policy=self.name, error=repr(exc))

    async def _load(self, version: int) -> None:
        started = time.perf_counter()
        with tracing.tracer().start_as_current_span("rollout.swap", context=Context()) as span:
            span.set_attributes({"treadle.model": self.name, "treadle.version": version})
            manifest, tensors = await fetch_state_dict(self.store, self.name, version)
        metadata = dict(manifest.metadata)
        await self._check_base(metadata, version)
        config = lora.from_metadata(metadata)
        await self.engine.load_adapter(self.name, tensors, config, version=version)
        self.version = version
        fetched = sum(c.size for t in manifest.tensors for c in t.chunks)
        if self.on_fetched is not None:
            with contextlib.suppress(Exception):  # accounting only
                await self.on_fetched(self.name, fetched)
        async with self._changed:
            self._changed.notify_all()
        log.info(
            "adapter policy swapped",
            policy=self.name,
            version=version,
            ms=round((time.perf_counter() - started) * 1e3, 2),
            fetched_mb=round(fetched / 2**20, 3),
        )

    async def _check_base(self, metadata: dict[str, str], version: int) -> None:
        """The adapter applies to full weights the engine holds, chunk for chunk."""
        where = f"{self.name}@{version}"
        if not lora.is_adapter(metadata):
            raise PolicyError(f"{where} is not a LoRA adapter")
        base = metadata.get("lora_base_model", "")
        if base != self.engine.model_name:
            raise PolicyError(f"{where} applies to model {base!r}; this replica serves "
                              f"{self.engine.model_name!r}")  # fmt: skip
        manifest = await self.store.get_manifest(base, int(metadata["lora_base_version"]))
        wanted = {c.hash for t in manifest.tensors for c in t.chunks}
        if not wanted <= self.engine.held_chunks():
            raise PolicyError(
                f"{where} applies to {base}@{manifest.version}, whose weights this replica "
                "does not hold"
            )


class RunPolicies:
    """The adapter policies this replica serves, by policy model name."""

    def __init__(
        self,
        engine: Engine,
        store: WeightStoreClient,
        max_resident: int = 32,
        poll_s: float = 2.0,
    ):
        self.engine, self.store = engine, store
        self.max_resident, self.poll_s = max_resident, poll_s
        self.policies: dict[str, AdapterPolicy] = {}
        self.js: object | None = None
        """JetStream, once NATS is connected: each policy then follows its announcements."""
        self.on_fetched: Callable[[str, int], Awaitable[None]] | None = None
        """Told (policy model, bytes) of each adapter version fetched (usage accounting)."""

    def is_adapter(self, model: str) -> bool:
        """Tasks naming `model` sample through an adapter: a LoRA run's policy on this
        replica's base (`names.adapter_policy`); any other name is the engine's own policy."""
        return model.startswith(self.engine.model_name + ".")

    def get(self, model: str) -> AdapterPolicy:
        policy = self.policies.get(model)
        if policy is None:
            policy = self.policies[model] = AdapterPolicy(
                model, self.engine, self.store, self.poll_s
            )
            policy.on_fetched = self.on_fetched
            if self.js is not None:
                policy._subscription = asyncio.ensure_future(
                    watch(self.js, model, policy.on_announcement)
                )
        policy.last_used = time.monotonic()
        return policy

    def version(self, model: str) -> int:
        """The version of `model` served: an adapter policy's, or the engine's own."""
        if not self.is_adapter(model):
            return self.engine.version
        policy = self.policies.get(model)
        return policy.version if policy is not None else -1

    async def ensure(self, model: str, version: int) -> None:
        if not self.is_adapter(model):
            raise ValueError(f"{model} is the engine's own policy")
        await self.get(model).ensure(version)
        await self._evict()

    async def _evict(self) -> None:
        """Unload the least recently used adapter policies beyond `max_resident`."""
        loaded = [p for p in self.policies.values() if p.version >= 0]
        loaded.sort(key=lambda p: p.last_used)
        for policy in loaded[: max(0, len(loaded) - self.max_resident)]:
            del self.policies[policy.name]
            await _unsubscribe(policy)
            with contextlib.suppress(Exception):
                await self.engine.unload_adapter(policy.name)
            log.info("adapter policy unloaded", policy=policy.name)

    def info(self) -> dict[str, int]:
        """Policy model -> the version served (loaded ones)."""
        return {n: p.version for n, p in sorted(self.policies.items()) if p.version >= 0}


async def _unsubscribe(policy: AdapterPolicy) -> None:
    future = policy._subscription
    if not isinstance(future, asyncio.Future):
        return
    if not future.done():
        future.cancel()
        return
    with contextlib.suppress(Exception):
        await future.result().unsubscribe()  # type: ignore[attr-defined]
