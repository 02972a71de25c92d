"""Stall detection: each service names its stages, what is pending in each, and ticks on
progress. A stage with pending work and no tick for `TREADLE_STALL_AFTER_S` is stalled: the
service logs it once (and again when it recovers), sets `treadle_stage_stalled{service,
stage}` to 1, and reports it in `/v1/info` (`progress`), which `treadle status` reads.

Liveness means progress: a *liveness* stage (work only this process can finish: generating,
training, scoring, stepping an env; not waiting for another service) stalled for
`TREADLE_LIVENESS_STALL_S` makes `/healthz` answer 503, so the supervisor (`treadle up`),
compose or Kubernetes restarts the process.

    rollout      tasks (groups in flight), generate (engine requests), weights (version lag)
    trainer      trajectories (runs collecting a batch), step (runs training)
    env-gateway  step (env steps in flight)
    reward       score (scoring requests in flight)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Gauge

from treadle_common.runtime.logs import get_logger

log = get_logger(__name__)
STALLED = Gauge(
    "treadle_stage_stalled",
    "1 while a stage has pending work and made no progress",
    ["service", "stage"],
)


class Stage:
    """One stage; `pending` says how much work waits on it (default: blocks in `track`)."""

    def __init__(
        self,
        service: str,
        name: str,
        pending: Callable[[], int] | None = None,
        liveness: bool = False,
    ):
        self.service, self.name = service, name
        self.liveness = liveness
        self.in_flight = 0
        self.pending = pending or (lambda: self.in_flight)
        self.done = 0
        self.last = time.monotonic()
        self.reported = False

    def tick(self, n: int = 1) -> None:
        self.done += n
        self.last = time.monotonic()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """One unit of work in flight while the block runs; progress when it ends."""
        if self.in_flight == 0:
            self.last = time.monotonic()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.tick()

    def snapshot(self, stall_after_s: float) -> dict[str, Any]:
        pending = int(self.pending())
        idle = time.monotonic() - self.last
        return {
            "pending": pending,
            "done": self.done,
            "idle_s": round(idle, 1),
            "stalled": pending > 0 and idle > stall_after_s,
        }


class Progress:
    def __init__(self, service: str, stall_after_s: float):
        self.service, self.stall_after_s = service, stall_after_s
        self.stages: dict[str, Stage] = {}

    def stage(
        self, name: str, pending: Callable[[], int] | None = None, liveness: bool = False
    ) -> Stage:
        return self.add(Stage(self.service, name, pending, liveness))

    def add(self, stage: Stage) -> Stage:
        """Watch a stage a component made itself."""
        self.stages[stage.name] = stage
        return stage

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: s.snapshot(self.stall_after_s) for name, s in self.stages.items()}

    def wedged(self, limit_s: float) -> list[str]:
        """Liveness stages with work pending and no progress for `limit_s` (0: never)."""
        if limit_s <= 0:
            return []
        now = time.monotonic()
        return [
            s.name
            for s in self.stages.values()
            if s.liveness and s.pending() > 0 and now - s.last > limit_s
        ]

    def check(self) -> list[str]:
        """Update gauges and logs; the names of the stalled stages."""
        stalled = []
        for stage in self.stages.values():
            if stage.pending() <= 0:
                stage.last = time.monotonic()  # idle time counts only while work is pending
            snap = stage.snapshot(self.stall_after_s)
            STALLED.labels(self.service, stage.name).set(1 if snap["stalled"] else 0)
            if snap["stalled"]:
                stalled.append(stage.name)
                if not stage.reported:
                    log.warning("stage stalled", stage=stage.name, **snap)
            elif stage.reported:
                log.info("stage progressing again", stage=stage.name, **snap)
            stage.reported = snap["stalled"]
        return stalled

    async def watch(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        while not stop.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
