"""Publishing the trainer's weights off the step's critical path, newest first.

    step s trains --snapshot (a copy of the weights, version V0 + s)--> Publisher.submit
        (returns at once) --one background task--> weight-store Publish --> announced on NATS

One publish runs at a time. A snapshot submitted while one runs waits; a newer snapshot
replaces a waiting one, which is then never published (counted as `coalesced`): rollout only
ever wants the newest weights, so when publishing is slower than training the versions in
between are skipped instead of queueing up. Version numbers are fixed by the step
(`V0 + step`), so a skipped version leaves a gap and staleness keeps counting in steps.

A sync run waits for the version its next batch needs (`wait_for`); an async run does not
wait (its rollout keeps generating with the version it has), but a trainer on the CPU lets a
publish in flight finish before its next step trains (`flush`): beside training it would
take the same cores and the GIL. A failed publish is
raised to the next caller of `submit`, `wait_for` or `flush` (the client already retried the
transient errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from treadle_common.runtime.logs import get_logger

log = get_logger(__name__)


@dataclass
class Snapshot:
    step: int
    version: int
    state: dict[str, torch.Tensor]
    submitted_at: float = 0.0


@dataclass
class Published:
    step: int
    version: int
    publish_s: float
    """Seconds the publish itself took (client to store to commit)."""
    latency_s: float
    """Seconds from submit to committed (waiting for an earlier publish included)."""
    bytes_sent: int


PublishFn = Callable[[Snapshot], Awaitable[int]]
"""Publishes one snapshot; returns the bytes sent."""


class Publisher:
    def __init__(self, publish: PublishFn, on_published: Callable[[Published], None]):
        self._publish = publish
        self._on_published = on_published
        self._waiting: Snapshot | None = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Condition()
        self.published_version = -1
        self.coalesced = 0
        self.error: BaseException | None = None

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    async def submit(self, snapshot: Snapshot) -> None:
        """Queue `snapshot` for publishing (replacing a waiting older one); returns at once."""
        self._check()
        snapshot.submitted_at = time.perf_counter()
        if self._waiting is not None:
            self.coalesced += 1
            log.info("publish coalesced", skipped=self._waiting.version, by=snapshot.version)
        self._waiting = snapshot
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="publisher")

    async def _run(self) -> None:
        while self._waiting is not None:
            snapshot, self._waiting = self._waiting, None
            started = time.perf_counter()
            try:
                sent = await self._publish(snapshot)
            except BaseException as exc:
                self.error = exc
                self._waiting = None
                async with self._changed:
                    self._changed.notify_all()
                if not isinstance(exc, Exception):
                    raise
                return
            done = time.perf_counter()
            self.published_version = snapshot.version
            self._on_published(
                Published(
                    snapshot.step,
                    snapshot.version,
                    done - started,
                    done - snapshot.submitted_at,
                    sent,
                )
            )
            async with self._changed:
                self._changed.notify_all()

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait_for(self, version: int) -> None:
        """Until `version` (or a newer one) is published."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.published_version >= version or self.error is not None
            )
        self._check()

    async def flush(self) -> None:
        """Until nothing waits or runs: the newest submitted snapshot is published."""
        while self.busy:
            assert self._task is not None
            await asyncio.shield(self._task)
        self._check()

    async def close(self) -> None:
        """Stop publishing (the run is over or failed); what waits is dropped."""
        self._waiting = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
