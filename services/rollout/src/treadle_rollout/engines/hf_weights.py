"""The hf engine's weight and adapter changes: a fetched version swapped in, a LoRA adapter
loaded or dropped, each applied on the engine's thread at the pause point between two steps
(no forward pass running). A full-weight version replaces the model's weights; a LoRA run's
adapter version becomes the policy's adapter on the base weights held. Policy `abort` restarts
the running (not streamed) turns from their prompts under the new weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from treadle_common.clients.torch_weights import ChunkCache, apply_fetch, tensors_of
from treadle_common.clients.weights import FetchResult, WeightStoreClient
from treadle_common.model import lora
from treadle_rollout import metrics
from treadle_rollout.engines import prefix_cache
from treadle_rollout.engines.base import SwapStats
from treadle_rollout.engines.hf_batch import Batch, Seq

SwapPolicy = Literal["continue", "abort"]
POLICY_ADAPTER = "__policy__"
"""The adapter name a LoRA run's policy version is loaded under (not a valid adapter name
for `/v1/adapters`, so the two never collide)."""


class WeightChanges:
    """The engine's part that changes its weights (`HFEngine` is one)."""

    model_name: str
    model: torch.nn.Module
    device: str
    cache: ChunkCache
    prefixes: prefix_cache.PrefixCache
    version: int
    swap_policy: SwapPolicy
    restarted_turns: int
    _batch: Batch
    _waiting: list[Seq]
    _waiting_lock: threading.Lock

    def _init_changes(self) -> None:
        self._swaps: list[tuple[FetchResult, asyncio.Future[float]]] = []
        self._adapter_ops: list[tuple[Callable[[], None], asyncio.Future[None]]] = []
        self._adapters: dict[str, int] = {}
        """Adapters served: name -> the version their tokens are tagged with."""
        self.base_version = 0
        """The full-weight version the model holds (0: the model directory)."""
        self.policy_adapter: str | None = None
        """Set while the policy is a LoRA run's adapter version: requests that name no
        adapter go through it."""

    def _ensure_scheduler(self) -> None:
        raise NotImplementedError

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        """Full weights, or a LoRA run's adapter version: then first the full-weight version
        it applies to, unless that is what the engine holds."""
        start = time.perf_counter()
        fetched = await store.fetch(
            self.model_name, version, have=self.held_chunks(), skip_assets=True
        )
        received = fetched.bytes_received
        metadata = dict(fetched.manifest.metadata)
        pause_s = 0.0
        if lora.is_adapter(metadata):
            base = int(metadata.get("lora_base_version", "0"))
            if base != self.base_version:
                full = await store.fetch(
                    self.model_name, base, have=self.held_chunks(), skip_assets=True
                )
                received += full.bytes_received
                pause_s += await self.swap(full)
        fetch_s = time.perf_counter() - start
        pause_s += await self.swap(fetched)
        return SwapStats(fetched.manifest.version, pause_s, fetch_s, received)

    async def swap(self, fetched: FetchResult) -> float:
        """Apply fetched weights at the next step boundary; return the pause in seconds. A
        LoRA adapter version becomes the policy's adapter (`policy_adapter`) on the base
        weights held; a full-weight version replaces them and drops it."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._swaps.append((fetched, future))
        self._ensure_scheduler()
        return await asyncio.shield(future)

    def held_chunks(self) -> set[str]:
        return self.cache.have()

    async def load_adapter(
        self, name: str, tensors: dict, config: lora.AdapterConfig, version: int = 0
    ) -> None:
        def apply() -> None:
            lora.inject(self.model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
            state = {k: t.to(self.device) for k, t in tensors.items()}
            lora.load_adapter(self.model, name, state, config)
            self._adapters[name] = version

        await self._adapter_op(apply)

    async def unload_adapter(self, name: str) -> None:
        def apply() -> None:
            lora.remove_adapter(self.model, name)
            self._adapters.pop(name, None)

        await self._adapter_op(apply)

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def _adapter_op(self, apply: Callable[[], None]) -> None:
        """Run `apply` at the next step boundary (no forward pass is running)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._adapter_ops.append((apply, future))
        self._ensure_scheduler()
        await asyncio.shield(future)

    def _apply(self, fetched: FetchResult) -> None:
        """A fetched version into the model (in the worker thread, at the pause point)."""
        metadata = dict(fetched.manifest.metadata)
        if not lora.is_adapter(metadata):
            apply_fetch(fetched, self.model.state_dict(), self.cache)
            self.base_version = fetched.manifest.version
            self.policy_adapter = None
            return
        lora.inject(self.model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
        tensors = {k: t.to(self.device) for k, t in tensors_of(fetched).items()}
        lora.load_adapter(self.model, POLICY_ADAPTER, tensors, lora.from_metadata(metadata))
        self.policy_adapter = POLICY_ADAPTER

    async def _apply_swaps(self) -> None:
        swaps, self._swaps = self._swaps, []
        for fetched, future in swaps:
            paused = time.perf_counter()
            try:
                await self._in_thread(self._apply, fetched)
            except Exception as exc:
                future.set_exception(exc)
                continue
            self.version = fetched.manifest.version
            self.prefixes.clear()  # cached KV belongs to the weights that computed it
            if self.swap_policy == "abort" and self._batch.seqs:
                rows = [i for i, s in enumerate(self._batch.seqs) if not s.streamed]
                restarted = [self._batch.seqs[i] for i in rows]
                for seq in restarted:
                    seq.restart()
                self.restarted_turns += len(restarted)
                metrics.RESTARTED_TURNS.inc(len(restarted))
                with self._waiting_lock:
                    self._waiting[:0] = restarted
                if len(rows) == len(self._batch.seqs):
                    self._batch.clear()
                elif rows:
                    self._batch.drop(rows)
            future.set_result(time.perf_counter() - paused)

    async def _apply_adapter_ops(self) -> None:
        ops, self._adapter_ops = self._adapter_ops, []
        for apply, future in ops:
            try:
                await self._in_thread(apply)
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)
