"""Worker processes for scorers that only compute (math, regex): a timeout kills them.

A pathological input (a regex that backtracks forever, arithmetic that grows without end)
holds whatever thread runs it; in the service's own process that would be the event loop,
and no `asyncio.timeout` can interrupt synchronous code. A `CpuScorer`'s `compute` therefore
runs in a pool of spawned processes (`pebble.ProcessPool`): past the timeout its worker is
killed and replaced, the request is answered TIMEOUT, and the replica keeps serving.

Only JSON crosses to a worker (the request as `ScoreInput` fields, the answer as `Score`
fields), with the scorer named by the module and class the registry loaded.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from typing import TYPE_CHECKING, cast

import pebble
from prometheus_client import Counter

from treadle_reward.scorers.base import Score, ScoreInput

if TYPE_CHECKING:
    from treadle_reward.scorers.base import CpuScorer

KILLED = Counter(
    "treadle_reward_workers_killed_total",
    "Scoring worker processes killed (a compute past its timeout, or one that died)",
    ["scorer", "reason"],
)


def _compute(module: str, qualname: str, request_json: str) -> str:
    """In the worker: the scorer class by name, its `compute` on the request."""
    from treadle_reward.scorers.base import CpuScorer

    cls = getattr(importlib.import_module(module), qualname)
    if not (isinstance(cls, type) and issubclass(cls, CpuScorer)):
        raise TypeError(f"{module}.{qualname} is not a CpuScorer")
    try:
        score = cls.compute(ScoreInput(**json.loads(request_json)))
    except Exception as exc:  # the scorer's error, sent back as text (never pickled)
        return json.dumps({"error": type(exc).__name__, "message": str(exc)})
    return json.dumps({"score": asdict(score)})


class WorkerDied(RuntimeError):
    """The worker scoring a request exited (killed by the OS, out of memory)."""


class ScorerFailed(RuntimeError):
    """The scorer raised in its worker (the message names the error)."""


class ScorerPool:
    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.kills = 0
        self._free = asyncio.Semaphore(workers)
        self._pool = pebble.ProcessPool(
            max_workers=workers, context=multiprocessing.get_context("spawn")
        )

    async def compute(self, scorer: CpuScorer, request: ScoreInput) -> Score:
        """`scorer.compute(request)` in a worker, within `timeout_s` of the call: waiting for
        a free worker counts, and a compute still running at the deadline has its worker
        killed (TimeoutError)."""
        cls = type(scorer)
        loop = asyncio.get_running_loop()
        called = loop.time()
        try:  # one request per worker: none waits in pebble's own queue
            async with asyncio.timeout(self.timeout_s):
                await self._free.acquire()
        except TimeoutError:
            raise TimeoutError(
                f"scorer {scorer.name} waited {self.timeout_s}s for a free worker"
            ) from None
        try:
            left = max(0.01, self.timeout_s - (loop.time() - called))
            future = self._pool.schedule(
                _compute,
                args=(cls.__module__, cls.__qualname__, json.dumps(asdict(request))),
                timeout=left,
            )
            try:
                answer = json.loads(await asyncio.wrap_future(cast(Future, future)))
            except FutureTimeout:
                self.kills += 1
                KILLED.labels(scorer.name, "timeout").inc()
                raise TimeoutError(
                    f"scorer {scorer.name} computed past {self.timeout_s}s; its worker was killed"
                ) from None
            except pebble.ProcessExpired as exc:
                self.kills += 1
                KILLED.labels(scorer.name, "died").inc()
                raise WorkerDied(f"scorer {scorer.name}'s worker exited ({exc})") from None
        finally:
            self._free.release()
        if "error" in answer:
            message = f"{answer['error']}: {answer['message']}"
            if answer["error"] == "TimeoutError":  # the scorer's own timeout (regex)
                raise TimeoutError(message)
            raise ScorerFailed(message)
        return Score(**answer["score"])

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=5)
