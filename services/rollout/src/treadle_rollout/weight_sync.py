"""Live weight updates: announcements on NATS -> delta fetch from the weight-store -> swap.

Only the chunks the engine does not hold travel. The swap happens at the engine's pause
point (between generations); every swap's pause is recorded.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from treadle_common.clients.weights import WeightStoreClient, watch
from treadle_common.logs import get_logger
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_rollout.engines.base import Engine

log = get_logger(__name__)


@dataclass
class SwapRecord:
    version: int
    pause_s: float
    fetch_s: float
    bytes_fetched: int
    at: float = field(default_factory=time.time)


class WeightSync:
    def __init__(self, engine: Engine, store: WeightStoreClient):
        self.engine = engine
        self.store = store
        self.swaps: list[SwapRecord] = []
        self._latest_announced = -1
        self._wake = asyncio.Event()
        self._swapped = asyncio.Condition()

    async def on_announcement(self, ann: pb.WeightAnnouncement) -> None:
        self._latest_announced = max(self._latest_announced, ann.version)
        self._wake.set()

    async def run(self, nc: NATS) -> None:
        await watch(nc.jetstream(), self.engine.model_name, self.on_announcement)
        while True:
            await self._wake.wait()
            self._wake.clear()
            target = self._latest_announced
            if target <= self.engine.version:
                continue
            try:
                await self.update_to(target)
            except Exception as exc:  # keep serving the old weights; retry shortly
                log.error("weight update failed", version=target, error=repr(exc))
                await asyncio.sleep(1.0)
                self._wake.set()

    async def ensure_version(self, version: int) -> None:
        """Wait until the engine holds at least `version` (tasks may demand a minimum)."""
        if self.engine.version >= version:
            return
        self._latest_announced = max(self._latest_announced, version)
        self._wake.set()
        async with self._swapped:
            await self._swapped.wait_for(lambda: self.engine.version >= version)

    async def update_to(self, version: int) -> SwapRecord:
        start = time.perf_counter()
        fetched = await self.store.fetch(
            self.engine.model_name, version, have=self.engine.held_chunks(), skip_assets=True
        )
        fetch_s = time.perf_counter() - start
        pause_s = await self.engine.update_weights(fetched)
        record = SwapRecord(version, pause_s, fetch_s, fetched.bytes_received)
        self.swaps.append(record)
        async with self._swapped:
            self._swapped.notify_all()
        log.info(
            "weights swapped",
            version=version,
            pause_ms=round(pause_s * 1e3, 2),
            fetched_mb=round(fetched.bytes_received / 2**20, 3),
        )
        return record
