"""Live weight updates: announcements on NATS -> delta fetch from the weight-store -> swap.

Only the chunks the engine does not hold travel. The swap happens at the engine's pause
point (between decode steps); every swap's pause is recorded. When the weight-store cannot
be reached the engine keeps serving the version it has; `last_error` says why (and the
service's `/readyz` reports it).

A version is announced once it is durable (on the store's disk or S3), which on a small
disk takes longer than the publish itself. A task that demands a version the engine lacks
does not wait for that: rollout asks the store to answer as soon as that version is
committed (`WaitForVersion`, at most `poll_s` per call; a committed version is served before
it is durable, from the store's memory). A sync run feeds a step's tasks while it publishes
the version they demand, so rollout has read them and waits in the store when the publish
commits. The same call makes up for a lost announcement.

An announcement is a claim, not a fact: when fetching the newest announced version fails and
the store's latest version is older, the announcement was forged, or named a version the
store lost in a crash; it is dropped and counted (`bad_announcements`,
`treadle_rollout_bad_announcements_total`) and the next newest one is fetched instead, so no
announcement can wedge rollout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from opentelemetry.context import Context

from treadle_common.clients.weights import WeightStoreClient, watch
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_rollout import metrics
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
    def __init__(self, engine: Engine, store: WeightStoreClient, poll_s: float = 2.0):
        self.engine = engine
        self.poll_s = poll_s
        self._wanted = -1  # the newest version a waiting task demands
        self.store = store
        self.swaps: list[SwapRecord] = []
        self.stage = Stage("rollout", "weights", lambda: self.version_lag)
        self._announced: set[int] = set()  # announced versions newer than the engine's
        self.bad_announcements = 0
        self._wake = asyncio.Event()
        self._swapped = asyncio.Condition()
        self.last_error: str | None = None

    @property
    def _latest_announced(self) -> int:
        return max(self._announced, default=-1)

    def _announce(self, version: int) -> None:
        if version > self.engine.version:
            self._announced.add(version)
        self._announced = {v for v in self._announced if v > self.engine.version}

    @property
    def version_lag(self) -> int:
        return max(0, self._latest_announced - self.engine.version)

    async def on_announcement(self, ann: pb.WeightAnnouncement) -> None:
        self._announce(ann.version)
        metrics.VERSION_LAG.set(self.version_lag)
        self._wake.set()

    async def run(self, nc: NATS) -> None:
        await watch(nc.jetstream(), self.engine.model_name, self.on_announcement)
        while True:
            await self._next_wake()
            target = self._latest_announced
            if target <= self.engine.version:
                continue
            try:
                await self.update_to(target)
            except Exception as exc:  # keep serving the old weights; retry shortly
                if await self._bogus(target):
                    continue
                self.last_error = f"update to version {target} failed: {exc!r}"
                log.error("weight update failed", version=target, error=repr(exc))
                await asyncio.sleep(1.0)
                self._wake.set()

    async def _next_wake(self) -> None:
        """Until an announcement (or a failed update's retry) wakes us; while a task waits for
        a version nothing announced, until the store commits it (or `poll_s` passes)."""
        if self._latest_announced > self.engine.version:
            self._wake.clear()  # fetch what was announced first
            return
        if self._wanted <= self.engine.version:
            await self._wake.wait()
            self._wake.clear()
            return
        self._wake.clear()
        try:
            latest = await self.store.wait_for_version(
                self.engine.model_name, self._wanted, self.poll_s
            )
        except Exception as exc:  # the store is away: the next round asks again
            self.last_error = f"asking the store for version {self._wanted} failed: {exc!r}"
            await asyncio.sleep(self.poll_s)
            return
        if latest is not None:
            self._announce(latest)  # committed: the store serves it

    async def _bogus(self, version: int) -> bool:
        """After a failed fetch of `version`: True (and it is forgotten) when the store has
        nothing that new, so it was never published there (or was lost)."""
        try:
            latest = await self.store.latest(self.engine.model_name)
        except Exception:  # the store is away: a plain failure, retried
            return False
        if latest is not None and latest >= version:
            return False
        self._announced.discard(version)
        if latest is not None:
            self._announce(latest)
        self.bad_announcements += 1
        metrics.BAD_ANNOUNCEMENTS.inc()
        log.warning("announced version the store does not have: ignored", version=version)
        self._wake.set()
        return True

    async def ensure_version(self, version: int) -> None:
        """Wait until the engine holds at least `version` (tasks may demand a minimum, which
        may not be published yet)."""
        if self.engine.version >= version:
            return
        if version > self._wanted:
            self._wanted = version
            self._wake.set()  # the run loop starts polling for it
        async with self._swapped:
            await self._swapped.wait_for(lambda: self.engine.version >= version)

    async def wait_for_newer(self, version: int, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the engine holds a version newer than `version`."""
        async with self._swapped:
            try:
                await asyncio.wait_for(
                    self._swapped.wait_for(lambda: self.engine.version > version), timeout_s
                )
            except TimeoutError:
                return False
        return True

    async def update_to(self, version: int) -> SwapRecord:
        with tracing.tracer().start_as_current_span("rollout.swap", context=Context()) as span:
            span.set_attributes(
                {"treadle.model": self.engine.model_name, "treadle.version": version}
            )
            stats = await self.engine.update_to(self.store, version)
        record = SwapRecord(stats.version, stats.pause_s, stats.fetch_s, stats.bytes_fetched)
        self.swaps.append(record)
        self._announce(-1)  # forget what this swap made old
        self.stage.tick()
        self.last_error = None
        metrics.SWAP_PAUSE.observe(stats.pause_s)
        metrics.VERSION_LAG.set(self.version_lag)
        async with self._swapped:
            self._swapped.notify_all()
        log.info(
            "weights swapped",
            version=stats.version,
            pause_ms=round(stats.pause_s * 1e3, 2),
            fetch_ms=round(stats.fetch_s * 1e3, 2),
            fetched_mb=round(stats.bytes_fetched / 2**20, 3),
        )
        return record
