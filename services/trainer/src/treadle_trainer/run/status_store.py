"""Where a run's status lives for every trainer to answer for (`GET /v1/runs/{id}` on any
replica): the status without its step records, and the step records not written yet, in
Redis, fenced by the run's lease; and the run's end (its final state, its keys' expiry).
Also which errors a later attempt of the run can fix (`retryable`), and how an error ends
an attempt (`verdict`)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from treadle_common import names
from treadle_common.api.runs import RunState, RunStatus, StepRecord
from treadle_common.fleet import retention
from treadle_common.runtime.logs import get_logger
from treadle_trainer import errors
from treadle_trainer.run.lease import Fenced, Lease

log = get_logger(__name__)


def retryable(exc: BaseException) -> bool:
    """An error that resuming the run later can fix: a service or Redis unreachable or
    restarting, a deadline, a batch that did not arrive in time (rollout away). Not a
    tenant's quota: more attempts would not make room."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if "quota " in (exc.details() or ""):
            return False
        return exc.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.CANCELLED,
        )
    transient = (
        redis_errors.ConnectionError,
        redis_errors.TimeoutError,
        redis_errors.BusyLoadingError,
        httpx.TransportError,
        ConnectionError,
        TimeoutError,
    )
    return isinstance(exc, transient)


def being_cancelled() -> bool:
    """This task was asked to stop (not: an awaited call ended in CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def verdict(
    exc: BaseException, run_id: str, lost: bool, last_attempt: bool
) -> tuple[RunState, str] | None:
    """How an exception out of a run's loop ends this attempt: (its state, its error), or None
    when this task itself is being cancelled (the caller re-raises). The lease taken over is
    `lost`; a call cancelled under the run or an infrastructure error (`retryable`) leaves it
    `retrying` (a new owner resumes it from its last checkpoint) unless this is the
    `last_attempt`; anything else `failed`."""
    if isinstance(exc, Fenced) or (isinstance(exc, asyncio.CancelledError) and lost):
        log.warning("run lost to another trainer", run=run_id, error=str(exc))
        return "lost", str(exc) or "the run's lease was taken over"
    if isinstance(exc, asyncio.CancelledError):
        if being_cancelled():
            return None
        # a library cancelled a call under us: an interruption, not a verdict
        log.warning("run interrupted; resuming", run=run_id, error=repr(exc))
        error = "CancelledError: a call was cancelled under the run"
        return ("failed" if last_attempt else "retrying"), error
    error = f"{type(exc).__name__}: {exc}"
    if retryable(exc) and not last_attempt:
        log.warning("run interrupted; resuming", run=run_id, error=repr(exc))
        return "retrying", error
    log.error("run failed", run=run_id, error=error)
    return "failed", error


class StatusStore:
    def __init__(self, r: aioredis.Redis, lease: Lease, status: RunStatus, retention_s: float):
        self.r, self.lease, self.status = r, lease, status
        self.retention_s = retention_s  # a finished run's keys expire after this
        self.steps_saved = 0  # status.steps[:this] are in Redis (run_steps)

    def queue(self, pipe: aioredis.client.Pipeline) -> None:
        """Queue the status (without step records) and the step records not written yet."""
        run = self.status.run_id
        new = self.status.steps[self.steps_saved :]
        if new:
            pipe.hset(names.run_steps(run), mapping={str(r.step): r.model_dump_json() for r in new})
        pipe.set(names.run_status(run), self.status.model_dump_json(exclude={"steps"}))

    async def save(self) -> None:
        """Write the status; fenced (a stale owner's write is refused and it stops); a Redis
        error only skips this write."""
        try:
            await self.lease.transaction(self.queue)
        except Fenced:
            raise
        except Exception as exc:
            log.warning("saving the run's status failed", run=self.status.run_id, error=repr(exc))
            return
        self.steps_saved = len(self.status.steps)

    async def end(self, outcome: RunState) -> RunState:
        """The run is over: its final state (out of the active runs and their policies), its
        keys to expire, unless another trainer owns it meanwhile ("lost")."""
        run = self.status.run_id
        self.status.state = outcome

        async def final(pipe) -> None:
            pipe.srem(names.RUNS_KEY, run)
            pipe.hdel(names.RUN_POLICIES, run)
            pipe.hset(names.run_state(run), "state", outcome)
            self.queue(pipe)
            await retention.expire_run(pipe, run, self.retention_s)

        try:
            await self.lease.transaction(final)
        except Fenced as exc:
            log.warning("run ended elsewhere meanwhile", run=run, error=str(exc))
            return "lost"
        return outcome


async def stored_status(r: aioredis.Redis, run_id: str, steps_from: int = 0) -> RunStatus:
    """The run's status as its owner last wrote it to Redis (the step records from
    `steps_from` on); 404 if there is none, 503 if Redis cannot be read."""
    try:
        raw = await r.get(names.run_status(run_id))
        if raw is None:
            raise errors.NotFound(f"no run {run_id}")
        status = RunStatus.model_validate_json(raw)
        fields = [str(s) for s in range(steps_from + 1, status.step + 1)]
        records = await r.hmget(names.run_steps(run_id), fields) if fields else []
    except errors.ServiceError:
        raise
    except Exception as exc:
        raise errors.Unavailable(f"run {run_id}: its state cannot be read: {exc!r}") from exc
    status.steps = [StepRecord.model_validate_json(r) for r in records if r is not None]
    return status
